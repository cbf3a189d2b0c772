"""vLLM's RL and dev-mode hooks on the Trio engine (``AsyncEngine`` inherits them): sleep mode
(``sleep`` / ``wake_up`` / ``is_sleeping``, with ``enable_sleep_mode``), ``pause_generation`` /
``resume_generation`` / ``is_paused``, ``reset_prefix_cache`` and ``collective_rpc``.

Each is run by every engine core between two of its steps (``core_control.py``); the caller
waits for all of them, or for the engine's death, which it raises.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from trillm.engine.core_control import (
    SLEEP_LEVELS,
    ControlledCore,
    PauseMode,
    check_pause_mode,
    check_wake_tags,
)
from trillm.engine.dp_lockstep import DUMMY_FORWARD
from trillm.errors import EngineDeadError

if TYPE_CHECKING:
    from trillm.config import TrillmConfig
    from trillm.engine.engine_cores import EngineCores


class EngineControl:
    """The hooks; the engine supplies its config, cores, death event and error."""

    config: TrillmConfig
    engine_cores: EngineCores
    died: trio.Event

    @property
    def dead_error(self) -> EngineDeadError | None:
        raise NotImplementedError  # the engine's

    # ------------------------------------------------------------------ sleep mode
    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """vLLM's sleep: ``mode`` says what becomes of the requests in flight (abort; keep:
        they finish after the wake-up; wait: they finish first); level 1 frees the KV cache,
        level 2 also the weights (read again from disk at wake-up). Requests sent meanwhile
        wait for the wake-up."""
        self._check_sleep_mode("sleep")
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level={level!r}: expected 1 or 2.")
        check_pause_mode(mode)
        self._check_no_pipeline("sleep")
        if mode == "wait":
            await self._drain_each_core()

        async def sleep(core: ControlledCore) -> None:
            await core.control.sleep(core, level, mode)
            if mode == "wait":
                core.control.resume()  # the held requests wait for the wake-up

        await self._on_each_core(sleep)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``tags``: what to restore, ``weights`` and/or ``kv_cache`` (None: both); the engine
        runs again once both are awake."""
        self._check_sleep_mode("wake_up")
        wanted = None if tags is None else list(tags)
        check_wake_tags(wanted)
        await self._on_each_core(lambda core: core.control.wake_up(core, wanted))

    async def is_sleeping(self) -> bool:
        return any(core.control.sleeping_tags for core in self.engine_cores.cores)

    # ------------------------------------------------------------------ pause
    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        """vLLM's: no step runs until ``resume_generation``; the requests in flight are
        aborted, kept, or waited for (``mode``: abort, keep, wait; new requests wait for the
        resume); ``clear_cache`` forgets the prefix cache."""
        check_pause_mode(mode)
        self._check_no_pipeline("pause")
        if mode == "wait":
            await self._drain_each_core()

        async def pause(core: ControlledCore) -> None:
            core.control.pause(core, mode, clear_cache)

        await self._on_each_core(pause)

    async def resume_generation(self) -> None:
        async def resume(core: ControlledCore) -> None:
            core.control.resume()

        await self._on_each_core(resume)

    async def is_paused(self) -> bool:
        return any(core.control.paused for core in self.engine_cores.cores)

    # ------------------------------------------------------------------ caches and RPC
    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; ``reset_running_requests``: preempt the running
        requests first (their tokens computed again). -> True (vLLM's success flag)."""

        async def reset(core: ControlledCore) -> None:
            if reset_running_requests:
                preempted = core.scheduler.preempt_running()
                await core.executor.collective_rpc("drop_requests", [preempted], {})
            core.scheduler.reset_prefix_cache()

        await self._on_each_core(reset)
        return True

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - vLLM's signature
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """``method`` (a name: code is never sent to the workers) on every worker's model
        runner, between steps -> each rank's result, engine core by engine core."""
        if not isinstance(method, str):
            raise TypeError(
                "collective_rpc: method must be a method name (str); callables are not "
                "sent to the workers."
            )
        if method == DUMMY_FORWARD:  # counted by the cores' lock-step, never sent alone
            raise ValueError(
                f"collective_rpc: {method!r} is run by the engine itself (expert parallelism "
                "over data-parallel engine cores keeps their forwards in lock-step)."
            )
        call_args, call_kwargs = list(args), dict(kwargs or {})

        async def rpc(core: ControlledCore) -> list[Any]:
            return await core.executor.collective_rpc(method, call_args, call_kwargs)

        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                per_core = await self._on_each_core(rpc)
        except trio.TooSlowError:
            raise TimeoutError(
                f"collective_rpc {method!r}: no answer within {timeout} s."
            ) from None
        return [value for values in per_core for value in values]

    # ------------------------------------------------------------------ helpers
    def _check_sleep_mode(self, what: str) -> None:
        if not self.config.enable_sleep_mode:
            raise ValueError(
                f"{what}: sleep mode is off; start the engine with --enable-sleep-mode "
                "(enable_sleep_mode=True)."
            )

    def _check_no_pipeline(self, what: str) -> None:
        if self.config.parallel.pipeline_parallel_size > 1:
            raise ValueError(f"{what} is not supported with pipeline parallelism.")

    async def _drain_each_core(self) -> None:
        """pause(mode="wait"): every core runs its requests to their end, then pauses."""

        async def drain(core: ControlledCore) -> trio.Event:
            return core.control.drain()

        for drained in await self._on_each_core(drain):
            await self._wait(drained)

    async def _on_each_core(self, fn: Callable[[ControlledCore], Awaitable[Any]]) -> list[Any]:
        if self.dead_error is not None:
            raise self.dead_error
        calls = self.engine_cores.post_calls(fn)
        for call in calls:
            await self._wait(call.done)
            if call.error is not None:
                raise call.error
        return [call.result for call in calls]

    async def _wait(self, event: trio.Event) -> None:
        """Waits for ``event``, or raises the engine's death."""
        async with trio.open_nursery() as nursery:

            async def watch_death() -> None:
                await self.died.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_death)
            await event.wait()
            nursery.cancel_scope.cancel()
        if not event.is_set():
            raise self.dead_error or EngineDeadError("The engine stopped.")
