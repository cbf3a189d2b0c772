"""``prompt_embeds`` on /v1/completions (vLLM's ``--enable-prompt-embeds``): the request's
prompts with its embeddings first (vLLM's order), each decoded and checked by
``trillm/engine/prompt_embeds.py`` (a long one off the event loop), then stage 2 as for ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from trillm.engine.prompt_embeds import decode_prompt_embeds, refuse_disabled
from trillm.engine.text_tokenizer import INLINE_TOKENIZE_CHARS
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.budgets import LogprobBudget, split_prompts
from trillm.entrypoints.openai.endpoints.completion_output import CompletionPrompt
from trillm.entrypoints.openai.endpoints.sampling import build_sampling_params
from trillm.entrypoints.openai.http.errors import BadRequestError, from_engine_exception
from trillm.entrypoints.openai.schemas.protocol import CompletionRequest


@dataclass(frozen=True, slots=True)
class Embeds:
    """One ``prompt_embeds`` entry, still base64 text."""

    text: str


RawPrompt = str | list[int] | Embeds


def raw_prompts(state: ServerState, req: CompletionRequest) -> list[RawPrompt]:
    """The request's prompt_embeds, then its prompts; an empty prompt beside prompt_embeds is
    no prompt (the openai client requires the field; vLLM's tests send "")."""
    if req.prompt in (None, "") and req.prompt_embeds in (None, []):
        # vLLM's rule and words, before whether prompt_embeds is enabled (its tests match them)
        raise BadRequestError(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    embeds: list[RawPrompt] = []
    if req.prompt_embeds is not None:
        if not state.preprocessor.enable_prompt_embeds:
            raise from_engine_exception(refuse_disabled())
        if req.echo:  # the embeddings have no text to echo (vLLM refuses it too)
            raise BadRequestError("'echo' is not supported with prompt_embeds.", "echo")
        given = req.prompt_embeds
        embeds = [Embeds(t) for t in ([given] if isinstance(given, str) else given)]
        if not embeds:
            raise BadRequestError("'prompt_embeds' must not be empty.", "prompt_embeds")
    if req.prompt is None or (embeds and req.prompt in ("", [])):
        return embeds
    return [*embeds, *split_prompts(req.prompt, "prompt")]


async def prepare_embeds_prompt(
    state: ServerState, req: CompletionRequest, prompt: Embeds, budget: LogprobBudget
) -> CompletionPrompt:
    pre = state.preprocessor
    hidden, max_len = pre.model_config.hidden_size, pre.max_model_len

    def decode() -> Any:
        return decode_prompt_embeds(prompt.text, hidden, max_len)

    if len(prompt.text) < INLINE_TOKENIZE_CHARS:
        tensor = decode()
    else:
        tensor = await trio.to_thread.run_sync(decode, limiter=pre.tokenize_limiter)
    params = build_sampling_params(state, req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    prepared = await pre.prepare(
        {"prompt_embeds": tensor}, params, priority=req.priority, cache_salt=req.cache_salt
    )
    budget.spend(prepared)
    return CompletionPrompt(prepared, None)
