"""P4, per request: a step's sampled tokens appended, the finish rules (length, EOS, stop
token ids) checked after each, and the request's ``EngineCoreOutput`` built. Used by
``Scheduler.update_from_output``; native twin: ``append_sampled`` / ``make_output`` in
``ext/step_outputs.pyx``.
"""

from __future__ import annotations

from trillm.core.request import Request
from trillm.messages import EngineCoreOutput, FinishReason, ModelRunnerOutput


def append_sampled(
    request: Request, sampled: list[int], max_model_len: int
) -> tuple[list[int], FinishReason | None, int | None]:
    """Append ``sampled`` up to the token that finishes the request -> (tokens appended,
    finish reason, stop token id)."""
    new_tokens: list[int] = []
    for token in sampled:
        request.append_output_token(token)
        new_tokens.append(token)
        reason, stop_reason = _check_stop(request, token, max_model_len)
        if reason is not None:
            return new_tokens, reason, stop_reason
    return new_tokens, None, None


def _check_stop(
    request: Request, token: int, max_model_len: int
) -> tuple[FinishReason | None, int | None]:
    num_output = request.num_output_tokens
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and num_output >= request.max_tokens
    ):
        return FinishReason.LENGTH, None
    if num_output < request.min_tokens:
        return None, None
    if not request.ignore_eos and token == request.eos_token_id:
        return FinishReason.STOP, None
    if token in request.stop_token_ids:
        return FinishReason.STOP, token
    return None, None


def make_output(
    request: Request,
    new_tokens: list[int],
    reason: FinishReason | None,
    stop_reason: int | None,
    out: ModelRunnerOutput,
    written: int = 0,
) -> EngineCoreOutput | None:
    """The request's output of the step (None: nothing new). ``written``: the prompt tokens
    in its blocks registered in the prefix cache, read before a finish freed them; on the
    output of its first token (or its finish: not a prompt-logprobs chunk's), less the hits,
    they are the tokens it wrote there (vLLM's ``num_cache_creation_tokens``)."""
    req_id = request.request_id
    prompt_logprobs = out.prompt_logprobs.get(req_id)
    if not new_tokens and reason is None and prompt_logprobs is None:
        return None
    num_cached = num_created = 0
    if not request.first_output_sent:
        request.first_output_sent = True
        num_cached = request.num_cached_tokens or 0
    if not request.cache_writes_sent and (new_tokens or reason is not None):
        request.cache_writes_sent = True
        num_created = max(0, written - (request.num_cached_tokens or 0))
    return EngineCoreOutput(
        request_id=req_id,
        new_token_ids=new_tokens,
        new_logprobs=out.logprobs.get(req_id),
        new_prompt_logprobs=prompt_logprobs,
        finish_reason=reason,
        stop_reason=stop_reason,
        num_cached_tokens=num_cached,
        num_cache_creation_tokens=num_created,
    )
