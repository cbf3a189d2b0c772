"""Speculation back-off: fewer drafts, or none for a while, for a request whose drafts fail.

A rejected draft still costs: a forward row per drafted position, and with a draft model its
forwards. The rule is per request, deterministic (it depends only on the request's own
verification history) and cheap (a few integers per request):

- ``limit`` (drafts to propose next) starts at ``k``. After a verification of ``d`` drafts with
  ``a`` accepted: all accepted -> ``min(k, max(limit, d + 1))`` (grow back one at a time);
  otherwise ``a + 1`` (propose about as far as the drafts were right, at least one).
- ``PATIENCE`` verifications in a row with none accepted pause the request: no drafts at its
  next ``pause`` proposal opportunities (one per engine step it decodes in); then it probes
  with one draft. The pause starts at ``FIRST_PAUSE`` and doubles at each pause up to
  ``MAX_PAUSE`` while probes keep failing (a probe that fails pauses again at once); any
  accepted draft resets it. A request whose drafts never succeed thus proposes about one
  draft per ``MAX_PAUSE`` steps once backed off: throughput-neutral within a few percent.
"""

from __future__ import annotations

from dataclasses import dataclass

PATIENCE = 2  # verifications in a row with nothing accepted before a pause
FIRST_PAUSE = 4  # proposal opportunities skipped by the first pause
MAX_PAUSE = 32  # the longest pause (in proposal opportunities)


@dataclass
class _State:
    limit: int
    misses: int = 0  # verifications in a row with nothing accepted
    paused: int = 0  # proposal opportunities still to skip
    next_pause: int = FIRST_PAUSE


class SpecBackoff:
    """req_id -> how many drafts to propose next; one owner: whoever proposes the drafts."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._states: dict[str, _State] = {}

    def _state(self, req_id: str) -> _State:
        state = self._states.get(req_id)
        if state is None:
            state = self._states[req_id] = _State(self.k)
        return state

    def limit(self, req_id: str) -> int:
        """Drafts the request may get at this proposal opportunity (0: paused; consulting a
        paused request counts one of its paused opportunities)."""
        state = self._states.get(req_id)
        if state is None:
            return self.k
        if state.paused:
            state.paused -= 1
            return 0
        return state.limit

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification of ``num_drafts`` drafts, ``num_accepted`` of them accepted."""
        if num_drafts <= 0:
            return
        state = self._state(req_id)
        if num_accepted >= num_drafts:
            state.limit = min(self.k, max(state.limit, num_drafts + 1))
        else:
            state.limit = num_accepted + 1
        if num_accepted:
            state.misses, state.next_pause = 0, FIRST_PAUSE
            return
        state.misses += 1
        if state.misses >= PATIENCE:
            state.paused = state.next_pause
            state.next_pause = min(MAX_PAUSE, 2 * state.next_pause)
            state.misses = PATIENCE - 1  # the probe after the pause pauses again if it fails
            state.limit = 1

    def forget(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def retain(self, live: set[str]) -> None:
        """Drops the state of every request not in ``live`` (finished, aborted)."""
        if len(self._states) > len(live) or any(r not in live for r in self._states):
            self._states = {r: s for r, s in self._states.items() if r in live}
