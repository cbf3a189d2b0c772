"""What the multi-rank executors (``multiproc.py``, ``ray_executor.py``) keep the same way, in
one place: the runner the ranks import by name (``runner_name``), the steps in flight
(``StepQueue``, the engine core's batch queue with its call order checked, and
``collective_rpc`` between steps only) and the executor's death (``Lifeline``: the first
error recorded, the calls in flight that it cancels). Nothing here calls back into an
executor: the executors call in, and stop their own workers."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import trio

from trillm.errors import EngineDeadError
from trillm.executor.abstract import RunnerFactory
from trillm.ipc import codec
from trillm.ipc.control import WorkerCall
from trillm.messages import SampleRequest, SchedulerOutput

P = TypeVar("P")  # what an executor keeps with each step it sent (Ray: the result refs)

NOT_STARTED = "The executor has not been started (await nursery.start(run))."
SHUT_DOWN = "The executor was shut down."


def runner_name(runner_factory: RunnerFactory, executor: str, imported_in: str) -> str:
    """The runner as the ``package.module:ClassName`` string the ranks import; a class (which
    cannot cross to another process) is a TypeError."""
    if not isinstance(runner_factory, str):
        raise TypeError(
            f"{executor} needs the runner as a 'package.module:ClassName' string "
            f"(it is imported in {imported_in}), got {runner_factory!r}."
        )
    return runner_factory


class StepQueue(Generic[P]):
    """Steps sent to the ranks and not collected yet, oldest first, and the newest one while
    its sampling (P3) has not started: up to ``max_batches`` steps in flight, each through
    ``add`` (``execute_model``), ``start_sampling``, then ``collect`` (``collect_step``)."""

    def __init__(self, max_batches: int) -> None:
        self.max_batches = max_batches
        self._pending: deque[tuple[SchedulerOutput, P]] = deque()
        self._unsampled: SchedulerOutput | None = None

    @property
    def newest(self) -> P:
        """What was kept with the newest step."""
        return self._pending[-1][1]

    def call_frame(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> bytes:
        """``collective_rpc``'s message to the ranks, which take it between steps only."""
        if self._pending:
            raise RuntimeError("collective_rpc called with steps in flight.")
        return codec.encode(WorkerCall(method, list(args), dict(kwargs)))

    def add(self, sched: SchedulerOutput, kept: P) -> None:
        if self._unsampled is not None or len(self._pending) >= self.max_batches:
            raise RuntimeError("execute_model called twice without sample_tokens in between.")
        self._pending.append((sched, kept))
        self._unsampled = sched

    def start_sampling(self, req: SampleRequest | None) -> SampleRequest | None:
        """The newest step's sampling starts -> the SampleRequest its ranks wait for (None:
        the step does not wait for a bitmask)."""
        sched = self._unsampled
        if sched is None:
            raise RuntimeError("sample_tokens called without execute_model.")
        if req is not None and not sched.wait_for_bitmask:
            raise ValueError("A SampleRequest was given for a step without wait_for_bitmask.")
        self._unsampled = None
        if not sched.wait_for_bitmask:
            return None
        return req or SampleRequest(sched.step_id)

    def collect(self) -> tuple[SchedulerOutput, P]:
        """The oldest step whose sampling started, out of the queue."""
        if not self._pending or self._pending[0][0] is self._unsampled:
            raise RuntimeError("collect_step called without a step whose sampling started.")
        return self._pending.popleft()


class Lifeline:
    """The executor's death: the first error recorded (every later call raises a copy of it),
    the calls in flight that it cancels, and ``failed`` set when it was not a shutdown."""

    def __init__(self) -> None:
        self.error: EngineDeadError | None = None
        self.failed = trio.Event()
        self._inflight: set[trio.CancelScope] = set()

    def end(self, error: EngineDeadError) -> bool:
        """Record ``error`` (unless one is) and cancel the calls in flight -> whether this is
        the first death."""
        first = self.error is None
        if first:
            self.error = error
        for scope in self._inflight:
            scope.cancel()
        return first

    def shut_down(self) -> bool:
        """The executor stops -> whether it was alive until now."""
        return self.end(EngineDeadError(SHUT_DOWN))

    def fail(self, error: EngineDeadError) -> bool:
        """A rank is gone -> whether this is the first death (then the executor stops its
        ranks)."""
        first = self.end(error)
        if first:
            self.failed.set()
        return first

    def death(self) -> EngineDeadError:
        """A fresh copy of the recorded death error (one instance per raise site)."""
        dead = self.error or EngineDeadError(SHUT_DOWN)
        return type(dead)(*dead.args)

    async def wait_failed(self) -> EngineDeadError:
        await self.failed.wait()
        return self.death()

    def check(self, started: bool) -> None:
        if self.error is not None:
            raise self.death()
        if not started:
            raise EngineDeadError(NOT_STARTED)

    @contextmanager
    def call(self, limit_s: float | None, shield: bool = False) -> Iterator[None]:
        """A call to the ranks: cancelled by the executor's death (the block ends early: its
        caller then raises ``death()``), ``trio.TooSlowError`` after ``limit_s`` (None: no
        limit). ``shield``: the caller's cancellation cannot interrupt it (a ring send must
        not leave half a message behind)."""
        with trio.CancelScope(shield=shield) as scope:
            self._inflight.add(scope)
            try:
                with trio.fail_after(limit_s if limit_s is not None else float("inf")):
                    yield
            finally:
                self._inflight.discard(scope)
