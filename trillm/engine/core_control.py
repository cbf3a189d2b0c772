"""Calls the frontend makes on an engine core between its steps (vLLM's utility calls): sleep
mode, pause / resume, reset_prefix_cache, collective_rpc.

A call travels as a ``CoreCall`` on the core's input channel, so it runs in the core's own
task, between two steps, when no step is in flight; the caller waits on its ``done`` event.
While the core sleeps or is paused it holds: it takes inputs (new requests wait in the
scheduler's queue, aborts end theirs) but schedules nothing until ``wake_up`` / ``resume``.

Pause (vLLM's ``pause_scheduler(mode)``): the requests in flight are aborted (``"abort"``,
vLLM's default), kept (``"keep"``: frozen where they are) or waited for (``"wait"``: they run
to their end while new ones are held, then the core pauses). Sleep (``sleep(level, mode)``)
settles them the same way, then preempts what is left (their tokens computed again after the
wake-up, greedy outputs unchanged); the prefix cache is forgotten, then every worker frees
its KV cache (level 1; on CPU the weights stay where they are) and at level 2 its model too,
read again from disk at ``wake_up`` (``trillm/worker/worker_rpc.py``). The core sleeps until
every tag (``weights``, ``kv_cache``) is awake again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import trio

from trillm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from trillm.worker.worker_rpc import SLEEP_TAGS

if TYPE_CHECKING:
    from trillm.core.scheduler import Scheduler
    from trillm.executor.abstract import Executor

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)


class ControlledCore(Protocol):
    """What the calls use of an engine core (``trillm/engine/core.py``'s ``EngineCore``)."""

    scheduler: Scheduler
    executor: Executor
    control: CoreControl


@dataclass(slots=True, eq=False)
class CoreCall:
    """One call on a core's control, answered (``result`` or ``error``, then ``done``) once
    the core has run it."""

    fn: Callable[[ControlledCore], Awaitable[Any]]
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    error: BaseException | None = None


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode={mode!r}: expected one of abort, wait, keep.")


def check_wake_tags(tags: list[str] | None) -> None:
    for tag in tags or ():
        if tag not in SLEEP_TAGS:
            raise ValueError(f"wake_up tag {tag!r}: expected weights or kv_cache.")


class CoreControl:
    """One core's sleep and pause state, and the calls waiting for its next pause between
    steps. Touched only by the core's task (the calls run there)."""

    def __init__(self) -> None:
        self.pending: list[CoreCall] = []
        self.paused = False
        self.sleeping_tags: set[str] = set()  # what is asleep: weights, kv_cache
        # Outputs of the requests a call aborted, for the core's loop to publish.
        self.aborted: list[EngineCoreOutput] = []
        # pause(mode="wait"): set once the requests in flight are done (the core then pauses);
        # the requests that come meanwhile are held here, admitted at the resume.
        self.draining: trio.Event | None = None
        self.held: list[EngineCoreRequest] = []
        self.released: list[EngineCoreRequest] = []  # held ones a resume let go

    @property
    def holds(self) -> bool:
        """No step may run: paused, or something asleep."""
        return self.paused or bool(self.sleeping_tags)

    async def run_pending(self, core: ControlledCore) -> None:
        calls, self.pending = self.pending, []
        for call in calls:
            try:
                call.result = await call.fn(core)
            except Exception as exc:
                call.error = exc
            finally:
                call.done.set()
        self.check_drained(core)

    def take_outputs(self, stats: SchedulerStats) -> EngineCoreOutputs:
        """What the calls aborted, with the scheduler's ``stats`` (a held core runs no step
        to publish them: /metrics shows the requests waiting for the wake-up)."""
        outputs, self.aborted = self.aborted, []
        return EngineCoreOutputs(outputs, time.monotonic(), stats)

    def take_released(self) -> list[EngineCoreRequest]:
        """The requests a resume released, for the core to admit (``core_loop.py``)."""
        released, self.released = self.released, []
        return released

    # ------------------------------------------------------------------ the calls
    def pause(self, core: ControlledCore, mode: str, clear_cache: bool) -> None:
        """vLLM's pause_scheduler: hold; the requests in flight aborted or kept."""
        self.paused = True
        self._settle(core, mode)
        if clear_cache:
            core.scheduler.reset_prefix_cache()

    def resume(self) -> None:
        """Steps again; a drain still under way ends (its pause call returns)."""
        self.paused = False
        if self.draining is not None:
            self.draining.set()
            self.draining = None
        self.released += self.held
        self.held = []

    def drain(self) -> trio.Event:
        """pause(mode="wait"): the requests in flight run to their end, new ones are held;
        -> set once the core has paused."""
        if self.draining is None:
            self.draining = trio.Event()
        return self.draining

    def hold(self, request: EngineCoreRequest) -> bool:
        """A new request, held while the core drains -> whether it was."""
        if self.draining is None:
            return False
        self.held.append(request)
        return True

    def forget_held(self, req_ids: list[str]) -> None:
        if self.held:
            dropped = set(req_ids)
            self.held = [r for r in self.held if r.request_id not in dropped]

    def check_drained(self, core: ControlledCore) -> None:
        """A drain ends, and the core pauses, once it holds no request."""
        if self.draining is not None and not core.scheduler.has_unfinished_requests():
            self.paused = True
            self.draining.set()
            self.draining = None

    async def sleep(self, core: ControlledCore, level: int, mode: str) -> None:
        if self.sleeping_tags:
            return  # already asleep (vLLM: a warning, nothing done)
        self._settle(core, mode)
        preempted = core.scheduler.preempt_running()  # "keep": their KV cache is about to go
        core.scheduler.reset_prefix_cache()
        await core.executor.collective_rpc("sleep", [level, preempted], {})
        self.sleeping_tags = set(SLEEP_TAGS)

    async def wake_up(self, core: ControlledCore, tags: list[str] | None) -> None:
        waking = [t for t in (tags or SLEEP_TAGS) if t in self.sleeping_tags]
        if waking:
            await core.executor.collective_rpc("wake_up", [waking], {})
            self.sleeping_tags.difference_update(waking)

    def _settle(self, core: ControlledCore, mode: str) -> None:
        """``abort``: every request in the scheduler ends now (finish_reason abort)."""
        if mode != "abort":
            return
        scheduler = core.scheduler
        ids = scheduler.running_req_ids() + scheduler.waiting_req_ids()
        scheduler.finish_requests(ids, FinishReason.ABORT)
        self.aborted += [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in ids]
