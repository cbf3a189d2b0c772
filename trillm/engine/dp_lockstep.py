"""The engine cores' forwards in lock-step when the MoE experts span every core's ranks
(``-dp N --enable-expert-parallel``, vLLM's data-parallel expert parallelism).

Each MoE layer of a forward is an all-to-all over every core's ranks
(trillm/distributed/expert_parallel.py), so forward n of one core can only finish once every
other core has run its own forward n, with tokens of its own or none. vLLM keeps its DP engine
processes in step with a coordinator and "waves" (an engine with no requests runs
``execute_dummy_batch`` while the wave lasts); here the cores are tasks of one Trio loop, so
one counter does it: ``ForwardCounter`` counts the forwards each core has sent to its workers
(a real step or a dummy one), and a core that has fewer than the most sends dummy forwards
(``expert_dummy_forward`` on its ranks: every MoE layer's exchanges with no tokens, no
attention, no KV write, no sampling) until it has as many. A core only sends its forward n + 1
once its forward n has answered, which needs every core's forward n, so no core is ever more
than one forward ahead, and a core that runs no step of its own (idle, every request waiting,
paused, its step's requests aborted or refused) is never what the others wait on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import trio

if TYPE_CHECKING:
    from trillm.executor.abstract import Executor

T = TypeVar("T")

DUMMY_FORWARD = "expert_dummy_forward"  # trillm/worker/worker_rpc.py
SETTLE_S = 10.0  # the longest a stopping core waits for the others' last forwards


class ForwardCounter:
    """Forwards sent by each engine core since the start; ``wait_behind`` wakes a core that
    another has gone past."""

    def __init__(self, num_cores: int) -> None:
        self.sent = [0] * num_cores
        self.dummies = [0] * num_cores  # of them, the dummy ones (tests, logs)
        self.settling = 0  # cores whose task has ended (``CoreLockstep.settle``)
        self._moved = trio.Event()

    def note_sent(self, index: int) -> None:
        """Core ``index`` handed one forward to its workers."""
        self.sent[index] += 1
        self.notify()

    def notify(self) -> None:
        self._moved.set()
        self._moved = trio.Event()

    async def wait_moved(self) -> None:
        await self._moved.wait()

    def behind(self, index: int) -> int:
        """How many forwards core ``index`` owes the others (0 or 1: see the module)."""
        return max(self.sent) - self.sent[index]

    async def wait_behind(self, index: int) -> None:
        while not self.behind(index):
            await self.wait_moved()


class CoreLockstep:
    """One engine core's side of the counter (``EngineCore.lockstep``)."""

    def __init__(self, counter: ForwardCounter, index: int) -> None:
        self.counter = counter
        self.index = index

    def note_sent(self) -> None:
        self.counter.note_sent(self.index)

    async def catch_up(self, executor: Executor) -> None:
        """Dummy forwards until this core has sent as many as the others. Each is counted
        before it is sent and shielded from cancellation: a dummy counted but never sent (the
        core's task cancelled at the send, as the engine stops) would leave the other cores'
        ranks waiting in an exchange this core's ranks never join. It cannot wait long: the
        core it matches has already sent that forward."""
        counter = self.counter
        while counter.behind(self.index):
            counter.note_sent(self.index)
            counter.dummies[self.index] += 1
            with trio.CancelScope(shield=True):
                await executor.collective_rpc(DUMMY_FORWARD, [], {})

    async def settle(self, executor: Executor) -> None:
        """The core's task has ended (the engine stops, or failed): until every core's has,
        it still sends the dummy forwards the others' last steps need, so that no rank is
        left waiting in an exchange when the workers are told to stop (it would die there,
        with a collective error, instead of leaving its group). A task stopped while it waited
        for its step's output sends them too: the dummy's answer is read past that output
        (``worker_calls.collect_call_results``). At most ``SETTLE_S``; errors (a dead worker)
        end it."""
        counter = self.counter
        counter.settling += 1
        counter.notify()
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + SETTLE_S
            with contextlib.suppress(Exception):
                while True:
                    await self.catch_up(executor)
                    if counter.settling == len(counter.sent):
                        return  # no core sends a step any more: the counts are final
                    await counter.wait_moved()

    async def receive(self, executor: Executor, inputs: trio.MemoryReceiveChannel[T]) -> T:
        """The core's next input, running the dummy forwards the others need meanwhile."""
        while True:
            await self.catch_up(executor)
            got: list[T] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_first, nursery, _take(inputs, got))
                nursery.start_soon(_first, nursery, self.counter.wait_behind(self.index))
            if got:  # NOTE: a cancelled receive takes nothing from the channel
                return got[0]


async def _take(inputs: trio.MemoryReceiveChannel[T], got: list[T]) -> None:
    got.append(await inputs.receive())


async def _first(nursery: trio.Nursery, waiting: Awaitable[None]) -> None:
    """``waiting``, then the race is over: the other waiter is cancelled."""
    await waiting
    nursery.cancel_scope.cancel()
