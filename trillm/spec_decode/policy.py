"""Which requests get drafts, and how many they can use: one rule for every proposer (the
n-gram one in the engine core, the draft model's in the worker).

Only requests whose sampling at a drafted position does not depend on the tokens before it
in ways the worker's one-pass verification would miss. Penalties (repetition, frequency,
presence), bad words, ``min_tokens`` not yet reached and structured outputs depend on the
tokens generated so far; such a request is served exactly, one token a step, without drafts
(it never sees a difference but speed).
"""

from __future__ import annotations

from trillm.sampling_params import SamplingParams


def may_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    return (
        params.structured_outputs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and not params.bad_words_token_ids
        and num_output_tokens >= params.min_tokens
    )


def draft_room(
    k: int, max_model_len: int, num_tokens: int, max_tokens: int | None, num_output_tokens: int
) -> int:
    """Drafts a request can still use: the step's own token is always sampled, so at most
    (tokens left) - 1, within max_tokens and max_model_len, and at most ``k``."""
    left = max_model_len - num_tokens
    if max_tokens is not None:
        left = min(left, max_tokens - num_output_tokens)
    return min(k, left - 1)
