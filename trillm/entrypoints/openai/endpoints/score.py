"""POST /score, /v1/score (vLLM's shape) and /rerank, /v1/rerank, /v2/rerank (vLLM's
Jina / Cohere-compatible shape), for an embedding model (cosine similarity) or a BERT-family
cross-encoder (``engine/scoring.py``). Every prompt is admitted as the other pooling routes'
are (``embedding.run_prepared``): the number of texts is bounded by the schema, each text by
the context length before it is tokenized, and the queue is checked before any tokenizing."""

from __future__ import annotations

import time
import uuid
from typing import Any

from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt
from trillm.engine.scoring import check_lengths, score_pairs, score_task
from trillm.entrypoints.openai.endpoints.admission import check_capacity
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.embedding import run_prepared
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.score import RerankRequest, ScoreRequest
from trillm.outputs import ScoringRequestOutput


def _activation(req: ScoreRequest | RerankRequest) -> bool:
    """vLLM's precedence: use_activation, then softmax, then activation; default on."""
    for value in (req.use_activation, req.softmax, req.activation):
        if value is not None:
            return value
    return True


async def _score(
    state: ServerState, req: ScoreRequest | RerankRequest, texts_1: list[str], texts_2: list[str]
) -> tuple[list[ScoringRequestOutput], int]:
    state.check_model(req.model)
    if req.mm_processor_kwargs is not None:
        raise BadRequestError(
            "mm_processor_kwargs: scoring takes text only here.", "mm_processor_kwargs"
        )
    engine = state.engine

    async def run(prepared: list[PreparedPrompt], task: str) -> list[Any]:
        call = engine.classify if task == "classify" else engine.encode
        rid = f"score-{uuid.uuid4().hex}"
        return await run_prepared(state, rid, prepared, lambda job, r: call(job, request_id=r))

    try:
        score_task(engine.config)
        check_lengths(len(texts_1), len(texts_2))
        check_capacity(state, seqs=len(texts_2) + (len(texts_1) if len(texts_1) > 1 else 0))
        return await score_pairs(
            engine.config,
            state.preprocessor,
            texts_1,
            texts_2,
            req.truncate_prompt_tokens,
            run,
            _activation(req),
            req.priority,
        )
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc), exc.param) from exc


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


async def create_score(state: ServerState, req: ScoreRequest) -> dict[str, Any]:
    outs, tokens = await _score(state, req, _as_list(req.text_1), _as_list(req.text_2))
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": req.model or state.served_model_names[0],
        "data": [
            {"index": i, "object": "score", "score": out.outputs.score}
            for i, out in enumerate(outs)
        ],
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }


async def create_rerank(state: ServerState, req: RerankRequest) -> dict[str, Any]:
    outs, tokens = await _score(state, req, [req.query], list(req.documents))
    order = sorted(range(len(outs)), key=lambda i: outs[i].outputs.score, reverse=True)
    if 0 < req.top_n < len(order):
        order = order[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": outs[i].outputs.score}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": req.model or state.served_model_names[0],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }
