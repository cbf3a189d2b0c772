"""Per-request budgets, checked before a request reaches the engine: what one request may ask
for in all its prompts and samples together, where each field alone is within its limit.

- logprob entries (``--max-logprob-entries``): every prompt token with ``prompt_logprobs``
  costs ``prompt_logprobs + 1`` entries (the token's own and the top ones) in each place the
  answer shows them (each of a completion's ``n`` choices), every sampled token with
  ``logprobs`` ``logprobs + 1``. An entry is ~375 bytes of Python objects in the server
  (measured: 256 prompts x 2,000 tokens x 21 entries grew RSS by 3.76 GiB) and ~55 bytes of
  JSON in the answer (565 MB for the same request);
- sequences (``--max-sequences-per-request``): prompts x ``n``, each an engine sequence with
  its own bookkeeping (and, before fair admission, a place in the queue ahead of later
  requests).

Both are 400s naming the budget and the fields that spend it: the request can never fit.
The prompts they count come from ``split_prompts`` (a request's ``prompt`` / ``input``).
"""

from __future__ import annotations

from typing import Any

from trillm.engine.preprocess import PreparedPrompt
from trillm.entrypoints.openai.http.errors import BadRequestError

# One prompt filling a 32k context with the default --max-logprobs (20) needs 688k entries;
# 2**20 (~375 MiB of Python objects, ~58 MB of JSON) fits it. The server raises the default
# to max_model_len x (max_logprobs + 1), so that one full-context sequence always fits.
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 20
# 8 x the largest ``n`` (128) and 4 x vLLM's default --max-num-seqs (256): a request larger
# than this is a batch job, better sent as several requests.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024


def default_max_logprob_entries(max_model_len: int, max_logprobs: int) -> int:
    """The budget without the flag: 2**20, or one full-context sequence at the largest
    ``logprobs`` the server allows, whichever is larger."""
    return max(DEFAULT_MAX_LOGPROB_ENTRIES, max_model_len * (max(max_logprobs, 0) + 1))


def logprob_entries(job: PreparedPrompt, prompt_copies: int = 1) -> int:
    """The logprob entries one prepared prompt may produce (its ``max_tokens`` resolved);
    ``prompt_copies``: how often the answer repeats its prompt logprobs (completions: in each
    of its ``n`` choices)."""
    params = job.params
    entries = 0
    if params.prompt_logprobs is not None:
        entries += prompt_copies * len(job.prompt_token_ids) * (params.prompt_logprobs + 1)
    if params.logprobs is not None:
        entries += params.n * (params.max_tokens or 0) * (params.logprobs + 1)
    return entries


class LogprobBudget:
    """Spent prompt by prompt as a request's prompts are prepared, so a request over the
    budget is refused at the first prompt that passes it, before the rest are tokenized."""

    __slots__ = ("limit", "logprobs_field", "prompt_copies", "used")

    def __init__(self, limit: int, logprobs_field: str, prompt_copies: int) -> None:
        self.limit = limit
        self.logprobs_field = logprobs_field  # the request's name for sample logprobs
        self.prompt_copies = prompt_copies  # see logprob_entries
        self.used = 0

    def spend(self, job: PreparedPrompt) -> None:
        self.used += logprob_entries(job, self.prompt_copies)
        if self.used > self.limit:
            param = "prompt_logprobs" if job.params.prompt_logprobs is not None else None
            param = param or self.logprobs_field
            raise BadRequestError(
                f"This request asks for at least {self.used} logprob entries, more than the "
                f"server's budget of {self.limit} per request (--max-logprob-entries): each "
                "prompt token counts prompt_logprobs + 1 (times n where each choice repeats "
                f"them) and each sampled token {self.logprobs_field} + 1, over all prompts and "
                "n samples. Lower "
                f"prompt_logprobs, {self.logprobs_field}, n or max_tokens, or send fewer "
                "prompts per request.",
                param,
            )


def check_sequences(num_prompts: int, n: int, limit: int) -> None:
    """400 when a request's prompts x ``n`` pass ``limit`` (--max-sequences-per-request)."""
    if num_prompts * n > limit:
        raise BadRequestError(
            f"This request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x n = "
            f"{n}), more than the server's budget of {limit} per request "
            "(--max-sequences-per-request). Lower n, or send fewer prompts per request.",
            "n",
        )


def split_prompts(value: str | list[Any], param: str) -> list[str | list[int]]:
    """A request's ``prompt`` / ``input`` as its prompts: a text, a list of texts, token ids
    (one prompt) or a list of token-id lists; empty: a 400 naming ``param``."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise BadRequestError(f"'{param}' must not be empty.", param)
    if isinstance(value[0], int):
        return [value]  # one prompt as token ids
    return list(value)
