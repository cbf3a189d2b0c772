"""The Trio engine (``open_engine``) on a thread of its own, for callers that are not Trio
code: ``LLM`` (blocking scripts) and ``AsyncLLM`` (asyncio).

The thread runs ``trio.run``; inside it the engine's nursery and a nursery for the callers'
tasks (``spawn``). Other threads reach it only through its ``TrioToken``: ``call`` blocks the
calling thread until an async function finishes there, ``spawn`` and ``run_soon`` hand work over
without waiting. ``shutdown`` cancels the callers' tasks, leaves ``open_engine`` (workers and
their processes stop) and joins the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from trillm.config.batch_defaults import UsageContext
from trillm.config.observability import NEEDS_ENDPOINT
from trillm.engine.async_engine import AsyncEngine
from trillm.engine.engine_startup import open_engine
from trillm.errors import EngineDeadError

T = TypeVar("T")


class EngineThread:
    """``open_engine(model, **engine_args)`` on a ``trio.run`` thread; started at once."""

    def __init__(
        self,
        model: str | None,
        engine_args: dict[str, Any],
        name: str,
        usage: UsageContext = UsageContext.ENGINE_CONTEXT,
    ) -> None:
        if engine_args.get("collect_detailed_traces"):  # LLM / AsyncLLM send no spans
            raise ValueError(NEEDS_ENDPOINT)  # vLLM's refusal without an endpoint
        self._model = model
        self._engine_args = engine_args
        self._usage = usage
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._engine: AsyncEngine | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            if not self._ready.is_set():
                self._startup_error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        async with open_engine(
            self._model, usage_context=self._usage, **self._engine_args
        ) as engine:
            async with trio.open_nursery() as nursery:
                self._engine = engine
                self._token = trio.lowlevel.current_trio_token()
                self._nursery = nursery
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()  # callers' tasks end before the engine does

    @property
    def engine(self) -> AsyncEngine:
        assert self._engine is not None
        return self._engine

    @property
    def is_alive(self) -> bool:
        return self.thread.is_alive()

    # ------------------------------------------------------------------ from other threads
    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread; blocks this thread until it returns."""
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def run_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run the synchronous ``fn(*args)`` on the engine thread soon; never blocks."""
        if self._token is None:
            raise EngineDeadError("The engine thread is not running.")
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise EngineDeadError("The engine has shut down.") from None

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start the task ``fn(*args)`` on the engine thread; never blocks."""
        self.run_soon(self._start_soon, fn, args)

    def _start_soon(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    def shutdown(self) -> None:
        """Stop the engine (its workers included) and join the thread. Idempotent."""
        stop = self._stop
        if stop is not None and self.thread.is_alive():
            try:
                self.run_soon(stop.set)
            except EngineDeadError:
                pass
        if self.thread is not threading.current_thread():
            self.thread.join()
