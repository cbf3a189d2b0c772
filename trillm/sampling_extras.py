"""Rules of three vLLM sampling fields that reach past one sampling step's logits.

- ``logprob_token_ids``: the logprobs of these token ids at every sampled position, instead of
  the top-k (vLLM's label-scoring field). ``logprobs`` becomes their count, so every logprob
  path (the worker's rows, the budget of ``--max-logprob-entries``, the output) treats them
  as k columns; the worker writes the chosen ids' values into those columns.
- ``thinking_token_budget``: with a reasoning parser, the tokens generated inside the
  reasoning section before its end is forced (``trillm/sample/thinking_budget.py``); -1 is
  vLLM's "unlimited" and becomes None.
- ``prompt_logprobs_temperature``: the prompt logprobs are the log_softmax of the prompt
  rows' logits divided by it (vLLM's; without it, of the logits as they are); a positive
  finite number, 1 becomes None. Without ``prompt_logprobs`` it has nothing to act on.
"""

from __future__ import annotations

import math
from typing import Any

from trillm.sampling_errors import SamplingParamsError

_INT64_MAX = 2**63 - 1  # (sampling_params.INT64_MAX; that module imports this one)
_FLOAT32_MAX = 3.4028234663852886e38  # (sampling_params.FLOAT32_MAX)
# vLLM's MAX_LOGPROB_TOKEN_IDS: the most ids one request may score per position (each sampled
# token then costs 1 + this many logprob entries, within --max-logprob-entries).
MAX_LOGPROB_TOKEN_IDS = 128


def normalise_extras(params: Any) -> None:
    """Checks the three fields of a SamplingParams (``SamplingParamsError`` naming the field)
    and writes vLLM's normal forms: an empty id list asks nothing, ``logprobs`` is the ids'
    count, budget -1 is no budget, prompt logprobs temperature 1 is none."""
    _normalise_prompt_temperature(params)
    ids = params.logprob_token_ids
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT64_MAX for t in ids
        ):
            raise SamplingParamsError(
                "logprob_token_ids", "logprob_token_ids must be a list of non-negative integers."
            )
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise SamplingParamsError(
                "logprob_token_ids",
                f"Requested logprob_token_ids of length {len(ids)}, which is greater than max "
                f"allowed: {MAX_LOGPROB_TOKEN_IDS}.",
            )
        if params.logprobs is not None and ids and params.logprobs != len(ids):
            raise SamplingParamsError(
                "logprob_token_ids",
                "When both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids). Got logprobs={params.logprobs}, "
                f"len(logprob_token_ids)={len(ids)}.",
            )
        params.logprob_token_ids = list(ids) or None
        if ids:
            params.logprobs = len(ids)
    budget = params.thinking_token_budget
    if budget is None:
        return
    if not isinstance(budget, int) or isinstance(budget, bool) or not -1 <= budget <= _INT64_MAX:
        raise SamplingParamsError(
            "thinking_token_budget",
            "thinking_token_budget must be a non-negative integer or -1 for unlimited, got "
            f"{budget!r}.",
        )
    params.thinking_token_budget = None if budget == -1 else budget


def _normalise_prompt_temperature(params: Any) -> None:
    value = params.prompt_logprobs_temperature
    if value is None:
        return
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0.0 < value <= _FLOAT32_MAX
    ):
        raise SamplingParamsError(
            "prompt_logprobs_temperature",
            f"prompt_logprobs_temperature must be a positive finite number, got {value!r}.",
        )
    params.prompt_logprobs_temperature = None if value == 1.0 else float(value)


def logprob_cap(max_logprobs: int, vocab_size: int) -> int:
    """The most logprobs (or prompt logprobs, top_logprobs) a request may ask for: the
    server's max_logprobs, whose -1 (vLLM's) caps at the vocabulary only. A request's own -1
    asks for the whole vocabulary, so it is served only when this is the vocabulary size."""
    return vocab_size if max_logprobs == -1 else max_logprobs
