"""Stage 10: stream pacing, the wake budget of the output processor.

Waking a stream's reader costs far more than the token it carries (an SSE chunk through the
HTTP stack), and all readers share the event loop with the engine core. Readers woken while
the model runs cost the engine nothing; beyond that they delay the next step. So a step wakes
at most ``max(wake_budget, model_time / CHUNK_COST_S)`` streams for a middle output (model time:
a moving average of the worker's time per step). With more streams than that, each stream is
woken once every ``ceil(streams / budget)`` steps (round robin, in its own slot) and carries
the tokens of those steps. A first output and a finish are never held, a stream that gets no
output in a step has what it holds delivered at once, and with fewer streams than the budget
(or a model slow enough to hide the writes) every token goes out at once.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from trillm.utils import cdiv

# At least this many streams are woken per engine step for a middle output (module docstring).
DEFAULT_WAKE_BUDGET = 32
# What waking a stream costs the event loop (one SSE chunk through the HTTP stack), roughly: a
# step whose model time covers N such chunks may wake N streams (they are written in its shadow).
CHUNK_COST_S = 50e-6

T = TypeVar("T")


class StreamPacing(Generic[T]):
    """Which stream is woken in which step; the held items (samples) are the caller's."""

    def __init__(self, wake_budget: int | None = DEFAULT_WAKE_BUDGET) -> None:
        if wake_budget is not None and wake_budget < 1:
            raise ValueError(f"wake_budget must be at least 1 (or None), got {wake_budget}.")
        self.wake_budget = wake_budget
        self.step = 0
        self._period = 1  # this step: a stream is woken (middle outputs) once per period steps
        self._model_time_s = 0.0  # moving average of the model's time per step
        self._streams = 0  # streams whose reader is woken per output (not FINAL_ONLY)
        self._streams_added = 0
        # key -> (item, the last step it had news): news held back by the budget
        self._held: dict[str, tuple[T, int]] = {}

    # ------------------------------------------------------------ streams
    def add_stream(self) -> int:
        """A new stream; returns its round-robin slot."""
        slot = self._streams_added
        self._streams_added += 1
        self._streams += 1
        return slot

    def remove_stream(self) -> None:
        self._streams -= 1

    # ------------------------------------------------------------ steps
    def begin_step(self, model_time_s: float) -> None:
        self.step += 1
        if self.wake_budget is None:
            return
        self._model_time_s += 0.2 * (model_time_s - self._model_time_s)
        budget = max(self.wake_budget, int(self._model_time_s / CHUNK_COST_S))
        self._period = cdiv(self._streams, budget) or 1

    def holds(self, slot: int) -> bool:
        """Whether a middle output of the stream in ``slot`` waits for a later step."""
        return self._period > 1 and (self.step + slot) % self._period != 0

    def hold(self, key: str, item: T) -> None:
        self._held[key] = (item, self.step)

    def release(self, key: str) -> None:
        if self._held:
            self._held.pop(key, None)

    def take_stalled(self) -> list[T]:
        """Held items that got no news this step (preempted, waiting): to be sent now."""
        if not self._held:
            return []
        step = self.step
        stalled = [key for key, (_, seen) in self._held.items() if seen != step]
        return [self._held.pop(key)[0] for key in stalled]

    def clear(self) -> None:
        self._held.clear()
        self._streams = 0
