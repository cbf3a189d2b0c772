"""``thinking_token_budget`` on the worker: each budgeted request's place in its reasoning
section, and the token it must sample next when the budget is spent (vLLM's thinking-budget
state, one request at a time).

A request is inside reasoning after the last start tag (``<think>``) that no end tag follows,
counting from the prompt (a template that opens ``<think>`` starts the output inside it, and
the prompt's tokens after the tag count), then token by token through the output. Once it
has generated ``budget`` tokens inside, the end tag's tokens are forced one by one (the
sampler leaves each row only that token); then the answer goes on unforced, and a later
start tag opens a new section with a fresh budget. The tags' ids come from the reasoning
parser (``SamplingParams.thinking_tag_ids``, filled in stage 2).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from trillm.sampling_params import SamplingParams


def _last_index(ids: Sequence[int], tag: Sequence[int]) -> int:
    """Where ``tag`` last starts in ``ids``; -1 when it does not occur."""
    n = len(tag)
    for i in range(len(ids) - n, -1, -1):
        if list(ids[i : i + n]) == list(tag):
            return i
    return -1


class ThinkingBudget:
    """One request: ``forced()`` before each sampled token, ``append`` after it."""

    def __init__(
        self, budget: int, start: list[int], end: list[int], prompt_ids: Sequence[int]
    ) -> None:
        self.budget = budget
        self.start, self.end = start, end
        last_start, last_end = _last_index(prompt_ids, start), _last_index(prompt_ids, end)
        self.thinking = last_start > last_end
        # tokens generated (or in the prompt) inside the open section
        self.count = len(prompt_ids) - last_start - len(start) if self.thinking else 0
        self.forcing: int | None = None  # index in ``end`` of the next forced token
        self._tail: deque[int] = deque(maxlen=max(len(start), len(end)))

    def forced(self) -> int | None:
        """The token the next position must be, or None (sampled as usual)."""
        if self.forcing is not None:
            return self.end[self.forcing]
        if self.thinking and self.count >= self.budget:
            return self.end[0]
        return None

    def append(self, token: int) -> None:
        self._tail.append(token)
        if self.forced() is not None:  # this token was the forced one
            after = (self.forcing or 0) + 1
            self.forcing = after if after < len(self.end) else None
            if self.forcing is None:
                self.thinking, self.count = False, 0
        elif self.thinking:
            if self._ends_with(self.end):
                self.thinking, self.count = False, 0
            else:
                self.count += 1
        elif self._ends_with(self.start):
            self.thinking, self.count = True, 0

    def _ends_with(self, tag: list[int]) -> bool:
        n = len(tag)
        return len(self._tail) >= n and list(self._tail)[-n:] == tag


class ThinkingBudgets:
    """The budgeted requests of one sampling state, by slot."""

    def __init__(self) -> None:
        self._by_slot: dict[int, ThinkingBudget] = {}

    def __bool__(self) -> bool:
        return bool(self._by_slot)

    def add(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        if params.thinking_token_budget is None or not params.thinking_tag_ids:
            return
        start, end = params.thinking_tag_ids
        self._by_slot[slot] = ThinkingBudget(params.thinking_token_budget, start, end, prompt_ids)

    def remove(self, slot: int) -> None:
        self._by_slot.pop(slot, None)

    def append_tokens(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        for slot, token in zip(slots, tokens):
            budget = self._by_slot.get(slot)
            if budget is not None:
                budget.append(int(token))

    def forced_rows(self, slots: Sequence[int]) -> tuple[list[int], list[int]]:
        """(rows, tokens): the batch rows whose request must sample a forced token."""
        rows: list[int] = []
        tokens: list[int] = []
        for row, slot in enumerate(slots):
            budget = self._by_slot.get(slot)
            token = None if budget is None else budget.forced()
            if token is not None:
                rows.append(row)
                tokens.append(token)
        return rows, tokens
