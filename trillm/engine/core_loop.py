"""An engine core's task (``run_engine_core``): drain inputs, step while there is work, sleep
on the input channel when idle; between two steps, the frontend's calls (sleep, pause,
collective_rpc: ``core_control.py``), and while the core holds (asleep or paused) no step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import trio
import trio.testing

from trillm.engine.core_control import CoreCall
from trillm.messages import EngineCoreInput, OutputHandlerInput

if TYPE_CHECKING:
    from trillm.engine.core import EngineCore

# Nothing schedulable although requests are unfinished (cannot happen with admission control
# and preemption, but never spin hot if it does).
_IDLE_BACKOFF_S = 0.001
# The longest an idle core, woken by a request, lets the event loop run before its first step
# (``_settle``).
SETTLE_MAX_S = 0.02

Inputs = trio.MemoryReceiveChannel[EngineCoreInput | CoreCall]


async def run_engine_core(
    core: EngineCore,
    inputs: Inputs,
    outputs: trio.MemorySendChannel[OutputHandlerInput],
    engine_index: int = 0,
    *,
    task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED,
) -> None:
    """The busy loop: drain inputs, step while there is work, sleep on the channel when idle.
    ``engine_index``: this core's index (data parallelism), stamped on its outputs."""
    task_status.started()
    async with outputs:
        while True:
            core.control.check_drained(core)  # pause(mode="wait") ends once nothing runs
            if core.control.pending or core.control.holds:
                await _between_steps(core, inputs, outputs, engine_index)
                if core.control.holds:
                    continue
            idle = not (core.scheduler.has_unfinished_requests() or core.num_in_flight)
            if idle and not core.has_refused:
                core.handle_input(await _receive(core, inputs))
                await _settle()
            _drain(core, inputs)
            lockstep = core.lockstep
            sent = None if lockstep is None else lockstep.counter.sent[lockstep.index]
            core.step_started = time.monotonic()
            try:
                result = await core.step()
            finally:
                core.step_started = None
            if lockstep is not None and lockstep.counter.sent[lockstep.index] == sent:
                await lockstep.catch_up(core.executor)  # no forward of its own: dummies
            if result is None:
                # NOTE: no back-off right after a step joined the batch queue: the next is due.
                stuck = core.scheduler.has_unfinished_requests() and not core.num_in_flight
                await trio.sleep(_IDLE_BACKOFF_S if stuck else 0)
                continue
            if result.outputs or result.scheduler_stats is not None:
                result.engine_index = engine_index
                await outputs.send(result)


async def _between_steps(
    core: EngineCore,
    inputs: Inputs,
    outputs: trio.MemorySendChannel[OutputHandlerInput],
    engine_index: int,
) -> None:
    """The frontend's calls, then what they aborted and the stats; while the core holds it
    then waits for the next input instead of stepping, and publishes the stats again once it
    has come."""
    control = core.control
    if control.pending:
        await control.run_pending(core)
        for request in control.take_released():  # held by a drain, let go by a resume
            core.handle_input(request)
        await _publish(core, outputs, engine_index)
    if control.holds and not control.pending:
        core.handle_input(await _receive(core, inputs))
        _drain(core, inputs)
        await _publish(core, outputs, engine_index)


async def _publish(
    core: EngineCore, outputs: trio.MemorySendChannel[OutputHandlerInput], engine_index: int
) -> None:
    message = core.control.take_outputs(core._stats())
    message.engine_index = engine_index
    await outputs.send(message)


async def _receive(core: EngineCore, inputs: Inputs) -> EngineCoreInput | CoreCall:
    """The next input; meanwhile, with the experts over every core (-dp N -ep), the dummy
    forwards the other cores' steps need (dp_lockstep.py)."""
    if core.lockstep is None:
        return await inputs.receive()
    return await core.lockstep.receive(core.executor, inputs)


async def _settle() -> None:
    """Lets the requests that reached the server with the one that woke the idle core reach it
    too before the first step: a burst (a client sending many at once) arrives over a few ms,
    and the HTTP tasks read and tokenize them one after another, while the first one's
    message already woke the core. Scheduling at once would start a step with that one alone
    and the rest would wait for the whole step (SmolLM2-135M, 16 x 256-token prompts: a
    256-token step, a quarter of a 2,048-token one's time, before the other 15 start). The core
    waits until no task is runnable and no socket is readable (the event loop is quiet: every
    request already received has been handed over), at most SETTLE_MAX_S: a lone request waits
    one pass of the event loop."""
    with trio.move_on_after(SETTLE_MAX_S):
        await trio.testing.wait_all_tasks_blocked()


def _drain(core: EngineCore, inputs: Inputs) -> None:
    while True:
        try:
            msg = inputs.receive_nowait()
        except trio.WouldBlock:
            return
        core.handle_input(msg)
