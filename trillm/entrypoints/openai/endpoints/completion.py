"""POST /v1/completions: prompts as text or token ids (one or many), JSON or SSE answers.

The endpoint calls each stage below it once, top to bottom: the request's checks and budgets
(``budgets.py``), per prompt its SamplingParams (``sampling.py``) and stage 2 (the engine's
preprocessor), the generation (``generation.py``), then the answer (``completion_output.py``:
read here for JSON, or handed to the SSE driver, ``sse_stream.py``). With several prompts
each runs as its own engine request.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.beam_search import beam_params
from trillm.entrypoints.openai.endpoints.budgets import (
    LogprobBudget,
    check_sequences,
)
from trillm.entrypoints.openai.endpoints.completion_embeds import (
    Embeds,
    RawPrompt,
    prepare_embeds_prompt,
    raw_prompts,
)
from trillm.entrypoints.openai.endpoints.completion_output import (
    CompletionAnswer,
    CompletionPrompt,
)
from trillm.entrypoints.openai.endpoints.generation import guard_stream, start_generation
from trillm.entrypoints.openai.endpoints.sampling import build_sampling_params, truncate_right
from trillm.entrypoints.openai.endpoints.sse_stream import sse_stream
from trillm.entrypoints.openai.http.errors import (
    BadRequestError,
    from_engine_exception,
)
from trillm.entrypoints.openai.schemas.protocol import CompletionRequest
from trillm.sampling_extras import logprob_cap


async def create_completion(
    state: ServerState, req: CompletionRequest
) -> dict[str, Any] | AsyncIterator[bytes]:
    lora = state.check_model(req.model)  # the adapter req.model names, if any
    _check_unsupported(req)
    _check_logprob_texts(state, req)
    vocab = state.preprocessor.vocab_size
    if req.logprobs == -1:  # vLLM's: the whole vocabulary
        req.logprobs = vocab
    if req.logprobs is not None and req.logprobs > logprob_cap(state.max_logprobs, vocab):
        raise BadRequestError(
            f"'logprobs' is {req.logprobs}, more than the server's limit of "
            f"{logprob_cap(state.max_logprobs, vocab)} (--max-logprobs).",
            "logprobs",
        )
    raw = raw_prompts(state, req)  # its prompt_embeds first, then its prompts
    check_sequences(len(raw), req.n, state.max_sequences_per_request)
    budget = LogprobBudget(state.max_logprob_entries, "logprobs", req.n)
    try:
        prompts = [await _prepare(state, req, p, budget) for p in raw]
    except ValueError as exc:  # the preprocessor's refusals name their field: 400
        raise from_engine_exception(exc) from exc
    request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    model_name = state.model_name if lora is None else lora.lora_name
    answer = CompletionAnswer(state, req, prompts, request_id, model_name)
    jobs = [p.prepared for p in prompts]
    beam = beam_params(req, jobs)
    gen = await start_generation(
        state,
        jobs,
        request_id,
        timeout=req.timeout,
        lora_request=lora,
        beam=beam,
        stream_interval=req.stream_interval,
    )
    if req.stream:
        usage = answer.include_usage
        return guard_stream(gen, sse_stream(gen, answer, answer.tracker, usage))
    return await answer.full(gen)


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise BadRequestError("'suffix' is not supported.", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise BadRequestError("'best_of' different from 'n' is not supported.", "best_of")


def _check_logprob_texts(state: ServerState, req: CompletionRequest) -> None:
    """Logprobs name their tokens by text, and echo gives the prompt's text, which needs the
    tokenizer: under --skip-tokenizer-init only as token ids (vLLM answers 400 too)."""
    as_ids = req.return_tokens_as_token_ids
    as_ids = state.return_tokens_as_token_ids if as_ids is None else as_ids
    if req.logprobs is not None and state.preprocessor.tokenizer_skipped and not as_ids:
        raise BadRequestError(
            "'logprobs' names each token by its text, which needs the tokenizer this server "
            "did not load (--skip-tokenizer-init / skip_tokenizer_init): ask for the tokens "
            "as ids with 'return_tokens_as_token_ids': true.",
            "logprobs",
        )
    if req.echo and state.preprocessor.tokenizer_skipped and not req.return_token_ids:
        # vLLM decodes the echoed prompt's text unless the ids are asked for instead.
        raise BadRequestError(
            "'echo' gives the prompt back as text, which needs the tokenizer this server did "
            "not load (--skip-tokenizer-init / skip_tokenizer_init): ask for the prompt's ids "
            "with 'return_token_ids': true.",
            "echo",
        )


async def _prepare(
    state: ServerState, req: CompletionRequest, prompt: RawPrompt, budget: LogprobBudget
) -> CompletionPrompt:
    """Stage 2 through the engine's preprocessor: tokenize (or check the ids), then truncate
    and check once (context, vocabulary, KV cache) with the request's SamplingParams; then
    spend the request's logprob budget (a 400 before the next prompt is tokenized)."""
    if isinstance(prompt, Embeds):
        return await prepare_embeds_prompt(state, req, prompt, budget)
    pre = state.preprocessor
    if isinstance(prompt, str):
        truncating = req.truncate_prompt_tokens is not None
        ids = await pre.tokenize(prompt, req.add_special_tokens, truncating=truncating)
        text: str | None = prompt
    else:
        pre.check_token_ids(prompt, "prompt")
        ids, text = prompt, None
    kept = truncate_right(req, ids, pre.max_model_len)
    if kept is not None and len(kept) != len(ids):
        ids, text = kept, None  # the text no longer matches the ids
    params = build_sampling_params(state, req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    if req.echo and req.logprobs is not None:
        # Echoed prompt tokens carry their logprobs too: ask the engine for them.
        asked = pre.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
        params.prompt_logprobs = max(asked or 0, req.logprobs)
    prepared = pre.prepare_ids(
        ids, params, text=text, priority=req.priority, cache_salt=req.cache_salt
    )
    budget.spend(prepared)
    echo = None
    if req.echo:  # the text of the ids served (a truncated prompt: the kept part)
        echo = prepared.text
        if echo is None:
            echo = state.tokenizer.decode(prepared.prompt_token_ids)
    return CompletionPrompt(prepared, echo)
