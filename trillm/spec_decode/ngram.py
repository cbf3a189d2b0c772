"""The n-gram proposer (prompt lookup): drafts copied from earlier in the request's own tokens.

It runs in the engine core, after P4: the scheduler owns every request's token history, and
the drafts must be in the scheduler before the next ``schedule()`` counts them in the token
budget, so proposing there needs no extra message to or from the worker and costs one
substring search per running request (microseconds; no model).

Which requests get drafts and how many: ``policy.py``; the per-request back-off
(``backoff.py``) is the engine core's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import numpy as np

from trillm.spec_decode.config import SpeculativeConfig
from trillm.spec_decode.policy import draft_room, may_speculate


def find_ngram_drafts(tokens: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
    """tokens: int32 [L]. The ``k`` tokens that followed the first earlier occurrence of the
    longest suffix n-gram (n from ``hi`` down to ``lo``); [] when none occurs. The first
    occurrence, not the latest: in a text that quotes its input it is the source being
    copied, and it has a full ``k`` tokens after it where a recent one may not."""
    size = len(tokens)
    if k <= 0 or size < lo + 1:
        return []
    data = tokens.tobytes()
    end = len(data) - 4  # a match must end before the suffix's last token
    for n in range(min(hi, size - 1), lo - 1, -1):
        pattern = data[-4 * n :]
        at = data.find(pattern, 0, end)
        while at >= 0 and at % 4:  # straddles token boundaries: not a whole-token match
            at = data.find(pattern, at + 1, end)
        if at >= 0:
            start = at // 4 + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    in_worker: Literal[False] = False  # proposes in the engine core

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.lo = config.prompt_lookup_min
        self.hi = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def _room(self, request: Any) -> int:
        return draft_room(
            self.k,
            self.max_model_len,
            request.num_tokens,
            request.max_tokens,
            request.num_output_tokens,
        )

    def propose(
        self, requests: Iterable[Any], limit: Callable[[str], int] | None = None
    ) -> dict[str, list[int]]:
        """req_id -> drafts for the running requests given (engine-side Request records);
        ``limit``: req_id -> at most that many drafts (the back-off)."""
        drafts: dict[str, list[int]] = {}
        for request in requests:
            room = self._room(request)
            if room <= 0 or not may_speculate(request.sampling_params, request.num_output_tokens):
                continue
            if limit is not None:
                room = min(room, limit(request.request_id))
                if room <= 0:
                    continue
            tokens = np.asarray(request.all_token_ids, dtype=np.int32)
            found = find_ngram_drafts(tokens, self.lo, self.hi, room)
            if found:
                drafts[request.request_id] = found
        return drafts
