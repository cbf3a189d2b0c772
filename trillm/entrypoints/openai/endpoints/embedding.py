"""POST /v1/embeddings (OpenAI's shape) and POST /pooling (vLLM's), for a pooling model
(``--runner pooling``). Each input is one engine request (stage 2 as for completions: the
preprocessor tokenizes, truncates and checks it); the engine pools its prompt
(``AsyncEngine.encode``). ``dimensions`` truncates a matryoshka model's vectors (then
renormalizes when the model normalizes); other models refuse it, as vLLM does.

Admission as for generation (``admission.admit``): a request holds one sequence per input,
and its tokens, against ``--max-num-queued-requests`` / ``--max-num-admitted-tokens`` from
before it reaches the engine until it ends by any path (done, error, client gone)."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

from trillm.config import PoolerConfig
from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt
from trillm.entrypoints.openai.endpoints.admission import admit, admitted_tokens, check_capacity
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.budgets import split_prompts
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
)
from trillm.outputs import pooling_params


def _check_pooling_model(state: ServerState, route: str) -> PoolerConfig:
    """The server's embedding pooler, else a 400 naming what the route needs."""
    pooler = state.engine.config.pooler
    if pooler is None:
        raise BadRequestError(
            f"{route} needs a pooling model: this server generates text. Start it with "
            "--runner pooling (or --convert embed) to serve embeddings.",
            "model",
        )
    if pooler.task == "classify":
        raise BadRequestError(
            f"{route}: this server's model is a sequence classifier; it serves /classify.", "model"
        )
    return pooler


async def prepare_input(
    state: ServerState, truncate_prompt_tokens: int | None, item: str | list[int]
) -> PreparedPrompt:
    """One input (text or token ids) tokenized, truncated and checked as a pooling request."""
    pre = state.preprocessor
    params = pooling_params(truncate_prompt_tokens)
    try:
        if isinstance(item, str):
            truncating = truncate_prompt_tokens is not None
            ids = await pre.tokenize(item, True, param="input", truncating=truncating)
            text: str | None = item
        else:
            pre.check_token_ids(item, "input")
            ids, text = item, None
        return pre.prepare_ids(ids, params, text=text)
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc), exc.param) from exc


def _dimensions(state: ServerState, pooler: PoolerConfig, req: EmbeddingRequest) -> int | None:
    if req.dimensions is None:
        return None
    if not pooler.matryoshka:
        raise BadRequestError(
            "Model does not support matryoshka representation, changing output dimensions "
            "will lead to poor results.",
            "dimensions",
        )
    hidden = state.model_config.hidden_size
    if req.dimensions > hidden:
        raise BadRequestError(
            f"dimensions must be at most {hidden}, got {req.dimensions}.", "dimensions"
        )
    return req.dimensions


def _vector(pooler: PoolerConfig, pooled: list[float], dims: int | None) -> np.ndarray:
    vec = np.asarray(pooled, dtype=np.float32)
    if dims is not None:
        vec = vec[:dims]
        if pooler.normalize:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec


def _encode(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: float32 little-endian bytes
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


async def run_inputs(
    state: ServerState,
    req: EmbeddingRequest | ClassificationRequest,
    kind: str,
    run: Callable[[PreparedPrompt, str], Awaitable[Any]],
) -> tuple[str, list[PreparedPrompt], list[Any]]:
    """A pooling request's inputs (``req.input``, ``req.truncate_prompt_tokens``), each one
    engine request, ``run(prepared, request_id)``, in its own task; all admitted together
    (``admission.admit``), each place released when its input ends, the rest on any way
    out (a sibling failed, the client left). -> (request id, prepared inputs, results)."""
    inputs = split_prompts(req.input, "input")
    check_capacity(state, seqs=len(inputs))  # refuse a full queue before tokenizing
    prepared = [await prepare_input(state, req.truncate_prompt_tokens, item) for item in inputs]
    request_id = f"{kind}-{uuid.uuid4().hex}"
    return request_id, prepared, await run_prepared(state, request_id, prepared, run)


async def run_prepared(
    state: ServerState,
    request_id: str,
    prepared: list[PreparedPrompt],
    run: Callable[[PreparedPrompt, str], Awaitable[Any]],
) -> list[Any]:
    """Prepared prompts admitted together and each run as ``run_inputs`` says."""
    ids = [f"{request_id}-{i}" for i in range(len(prepared))]
    admission = admit(state, ids, 1, [admitted_tokens(p) for p in prepared])
    results: list[Any] = [None] * len(prepared)
    # /metrics and, with --otlp-traces-endpoint, a span per input (metrics/pooling.py).
    trace = None if state.tracing is None else state.tracing.request(None, state.model_name)
    timer = state.metrics.pooling_timer(len(prepared), trace)

    async def one(i: int) -> None:
        try:
            results[i] = await run(prepared[i], ids[i])
            timer.pooled(i, results[i])
        finally:
            admission.release(ids[i])

    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(prepared)):
                nursery.start_soon(one, i)
    finally:
        admission.release_all()  # inputs never started
        timer.close()
    return results


async def create_embedding(state: ServerState, req: EmbeddingRequest) -> dict[str, Any]:
    route = "/pooling" if isinstance(req, PoolingRequest) else "/v1/embeddings"
    state.check_model(req.model)
    pooler = _check_pooling_model(state, route)
    dims = _dimensions(state, pooler, req)
    request_id, prepared, results = await run_inputs(
        state, req, "embd", lambda job, rid: state.engine.encode(job, request_id=rid)
    )
    data = []
    for i, out in enumerate(results):
        vec = _encode(_vector(pooler, out.outputs.embedding, dims), req.encoding_format)
        if isinstance(req, PoolingRequest):
            data.append({"index": i, "object": "pooling", "data": vec})
        else:
            data.append({"index": i, "object": "embedding", "embedding": vec})
    tokens = sum(len(p.prompt_token_ids) for p in prepared)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": req.model or state.served_model_names[0],
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
