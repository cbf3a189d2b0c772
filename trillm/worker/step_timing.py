"""``--collect-detailed-traces`` on a rank: each step's model forward time (``model``) and the
time of the worker's execute call, P2 and P3 together (``worker``), in seconds, on the step's
``ModelRunnerOutput`` (vLLM V0's ``model_forward_time`` / ``model_execute_time``; the engine
core sums them per request, ``engine/core_traces.py``).

Off (the default), a runner's ``ForwardClock`` is a no-op context and ``stamp`` returns the
output untouched: no clock is read. On CUDA the forward is timed by a pair of CUDA events per
forward (as vLLM does; no synchronisation in the step), read once the step's tokens are back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from trillm.config import TrillmConfig
    from trillm.messages import ModelRunnerOutput

T = TypeVar("T")


class ForwardClock:
    """A runner's forward timer: ``with clock:`` around the forward; ``stamp(out)`` puts the
    step's summed forward seconds on its output (pipeline stage: this stage's) and restarts."""

    __slots__ = ("on", "cuda", "seconds", "_events", "_t0")

    def __init__(self, config: TrillmConfig, cuda: bool | None = None) -> None:
        self.on = config.collect_model_forward_time
        self.cuda = config.device.startswith("cuda") if cuda is None else cuda
        self.seconds = 0.0
        self._events: list[Any] = []  # CUDA: (start, end) event pairs of the step
        self._t0 = 0.0

    def __enter__(self) -> None:
        if not self.on:
            return
        if self.cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, end))
        else:
            self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if not self.on:
            return
        if self.cuda:
            self._events[-1][1].record()
        else:
            self.seconds += time.perf_counter() - self._t0

    def stamp(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        if not self.on:
            return out
        seconds = self.seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0  # CUDA events measure milliseconds
        out.model_forward_time = seconds
        self.seconds, self._events = 0.0, []
        return out


class ExecuteClock:
    """The worker's side (``Worker``, ``UniProcExecutor``): ``run`` times each runner call of
    a step; ``stamp`` puts their sum (P2 + P3, not the wait between them for a grammar's
    bitmask) on the step's output and restarts."""

    __slots__ = ("on", "seconds")

    def __init__(self, on: bool) -> None:
        self.on = on
        self.seconds = 0.0

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.on:
            return fn(*args)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def stamp(self, out: ModelRunnerOutput) -> None:
        if self.on:
            out.model_execute_time, self.seconds = self.seconds, 0.0


def stage_times(
    out: ModelRunnerOutput, outputs: list[ModelRunnerOutput], output_rank: int
) -> ModelRunnerOutput:
    """The step's output (``output_rank``'s) with its times summed over the pipeline stages,
    each stage's first rank's (its tensor-parallel ranks run the step together), as vLLM V0
    carried them from stage to stage: a step's batch passes the stages one after another.
    Without stages (``output_rank`` 0) rank 0's times stand."""
    if not output_rank or (out.model_forward_time is None and out.model_execute_time is None):
        return out
    firsts = outputs[:: len(outputs) - output_rank]
    if out.model_forward_time is not None:
        out.model_forward_time = sum(o.model_forward_time or 0.0 for o in firsts)
    if out.model_execute_time is not None:
        out.model_execute_time = sum(o.model_execute_time or 0.0 for o in firsts)
    return out
