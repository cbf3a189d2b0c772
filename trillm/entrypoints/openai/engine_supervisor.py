"""The server's engine, watched.

When the engine dies (a worker killed, the engine core failing), the engine itself fails every
in-flight request at once, and ``/health`` and new requests answer 503. The supervisor then
either ends the process with exit code 1 after ``ENGINE_DEATH_GRACE_S`` (the default; vLLM
exits too, for systemd or Kubernetes to restart it), or, with ``--restart-on-engine-death``,
closes the dead engine and opens a fresh one in its place, within the same process and
listener.

The server holds an ``EngineSlot``: it forwards to the current engine, so a restart swaps one
reference; while the new engine loads, the dead one answers (503s). A SIGTERM during a restart
waits for the load to finish, then shuts down as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, cast

import trio

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine

logger = logging.getLogger("trillm.server")

# After the engine dies, in-flight requests get their error and /health its 503 for this long;
# then the process exits with code 1.
ENGINE_DEATH_GRACE_S = 2.0


class EngineSlot:
    """The current engine: attribute reads go to it (``state.engine.generate``, ...)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.current = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)

    def as_engine(self) -> AsyncEngine:
        """The slot, typed as the engine it forwards to: what the server holds (the state, the
        metrics), so that a restart swaps one reference and mypy checks every use."""
        return cast("AsyncEngine", self)


async def supervise_engine(
    open_engine: Callable[[], AbstractAsyncContextManager[Any]],
    restart: bool,
    life: Any,
    done: trio.Event,
    *,
    task_status: trio.TaskStatus[EngineSlot] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the engine until ``done`` (the HTTP server has stopped); report it through
    ``task_status`` once ready. On its death: ``life.exit_code = 1`` and ``life.stop`` after
    the grace period, or (``restart``) a new engine in the slot."""
    slot: EngineSlot | None = None
    restarts = 0
    while True:
        async with open_engine() as engine:
            if slot is None:
                slot = EngineSlot(engine)
                task_status.started(slot)
            else:
                slot.current = engine
                logger.warning("The engine is running again (restart %d).", restarts)
            await _first_of(engine.died.wait, done.wait)
            if done.is_set():
                return
            if not restart:
                logger.error(
                    "The engine died (%s); exiting with code 1 in %.0f s "
                    "(--restart-on-engine-death restarts it instead).",
                    engine.dead_error,
                    ENGINE_DEATH_GRACE_S,
                )
                life.exit_code = 1
                with trio.move_on_after(ENGINE_DEATH_GRACE_S):
                    await done.wait()
                life.stop.set()
                await done.wait()
                return
            restarts += 1
            logger.error(
                "The engine died (%s); restarting it (--restart-on-engine-death).",
                engine.dead_error,
            )
        # (leaving open_engine has shut the dead engine's executor and workers down)


async def _first_of(*waits: Callable[[], Awaitable[Any]]) -> None:
    async with trio.open_nursery() as nursery:
        for wait in waits:

            async def run(wait: Callable[[], Awaitable[Any]] = wait) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)
