"""Stage 10: logprobs formatted once, for every reader (the Python API and the HTTP layer).

Each position becomes ``{token_id: Logprob(logprob, rank, decoded_token)}``: the sampled (or
actual prompt) token, then the top-k by rank (vLLM's layout); ``in_rank_order`` reads it by
rank without sorting. Readers never decode or rank again; the token texts come from one cache
(``TokenTexts``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trillm.engine.skipped_tokenizer import SkippedTokenizer
from trillm.messages import LogprobsLists
from trillm.outputs import Logprob, SampleLogprobs

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer


class TokenTexts:
    """``decode([token_id])`` per token id, cached (the texts of logprob entries). Without a
    tokenizer (--skip-tokenizer-init) an entry's text is None, as vLLM's ``decoded_token``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.skipped = isinstance(tokenizer, SkippedTokenizer)
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.skipped:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def make_logprob_dict(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    rank: int,
    num_logprobs: int,
    decode: Callable[[int], str | None],
) -> dict[int, Logprob]:
    """One position (vLLM's order): the sampled (or actual prompt) token with its rank, then
    the top-k in rank order; a sampled token that is also in the top-k keeps its first place
    with the top-k entry's values.

    ``token_ids``/``logprobs`` are a LogprobsLists row, [sampled, top-1, ..., top-k'] with
    k' >= num_logprobs.
    """
    ranks = [rank, *range(1, num_logprobs + 1)]
    row = zip(token_ids[: num_logprobs + 1], logprobs[: num_logprobs + 1], ranks)
    return {tid: Logprob(float(lp), r, decode(tid)) for tid, lp, r in row}


def in_rank_order(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """A ``make_logprob_dict`` position by rank (top-1 first), from its known layout: the
    first entry goes to its rank's place (after the top-k when it is not one of them). No
    sorting, no decoding: what readers (the HTTP layer) show is what was formatted here."""
    items = list(entry.items())
    if len(items) < 2:
        return items
    first, tops = items[0], items[1:]
    rank = first[1].rank
    if rank is not None and 1 <= rank <= len(tops):
        tops.insert(rank - 1, first)
    else:
        tops.append(first)
    return tops


@dataclass(slots=True)
class SampleLogprobsBuilder:
    """Sample logprobs of one sample (``SamplingParams.logprobs`` = k)."""

    k: int
    rows: SampleLogprobs = field(default_factory=list)
    cumulative: float = 0.0

    def add(self, lists: LogprobsLists, count: int, decode: Callable[[int], str | None]) -> None:
        for pos in range(min(count, len(lists.token_ids))):
            ids, lps = lists.token_ids[pos], lists.logprobs[pos]
            self.rows.append(make_logprob_dict(ids, lps, lists.ranks[pos], self.k, decode))
            self.cumulative += float(lps[0])


def slice_lists(lists: LogprobsLists, start: int, stop: int) -> LogprobsLists:
    if start == 0 and stop >= len(lists.token_ids):
        return lists
    return LogprobsLists(
        token_ids=lists.token_ids[start:stop],
        logprobs=lists.logprobs[start:stop],
        ranks=lists.ranks[start:stop],
    )
