"""Sleep mode, pause and ``collective_rpc`` (``engine_control.py``) for the engines on a thread
of their own: ``LLMControl`` blocks (``LLM``), ``AsyncLLMControl`` awaits (``AsyncLLM``); each
call runs on the engine's Trio thread."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from trillm.engine.core_control import PauseMode
from trillm.engine.engine_thread import EngineThread
from trillm.errors import EngineDeadError


class LLMControl:
    _thread: EngineThread

    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        self._thread.call(self._thread.engine.sleep, level, mode)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._thread.call(self._thread.engine.wake_up, tags)

    def is_sleeping(self) -> bool:
        return self._thread.call(self._thread.engine.is_sleeping)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self._thread.call(self._thread.engine.reset_prefix_cache, reset_running_requests)

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        engine = self._thread.engine
        return self._thread.call(engine.collective_rpc, method, timeout, args, kwargs)


class AsyncLLMControl:
    _thread: EngineThread

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        await self._on_engine(self._thread.engine.sleep, level, mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self._on_engine(self._thread.engine.wake_up, tags)

    async def is_sleeping(self) -> bool:
        result: bool = await self._on_engine(self._thread.engine.is_sleeping)
        return result

    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        engine = self._thread.engine
        await self._on_engine(lambda: engine.pause_generation(mode=mode, clear_cache=clear_cache))

    async def resume_generation(self) -> None:
        await self._on_engine(self._thread.engine.resume_generation)

    async def is_paused(self) -> bool:
        result: bool = await self._on_engine(self._thread.engine.is_paused)
        return result

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        engine = self._thread.engine
        result: bool = await self._on_engine(engine.reset_prefix_cache, reset_running_requests)
        return result

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - vLLM's signature
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        engine = self._thread.engine
        result: list[Any] = await self._on_engine(
            engine.collective_rpc, method, timeout, args, kwargs
        )
        return result

    async def _on_engine(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``fn(*args)`` as a task on the engine thread; its result or error here."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        async def run() -> None:
            value: Any = None
            error: BaseException | None = EngineDeadError("The engine has shut down.")
            try:
                value = await fn(*args)
                error = None
            except Exception as exc:  # handed to the caller
                error = exc
            finally:
                loop.call_soon_threadsafe(_settle, done, value, error)

        self._thread.spawn(run)
        return await done


def _settle(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
