"""``AsyncLLM``: the engine for asyncio code (vLLM's ``AsyncLLM`` shape).

    llm = AsyncLLM(model, **engine_args)          # or AsyncLLM.from_engine_args(EngineArgs(...))
    async for out in llm.generate(prompt, SamplingParams(...), request_id):
        ...
    await llm.abort(request_id); llm.shutdown()    # or: async with AsyncLLM(...) as llm:

The Trio engine runs on a thread of its own (``engine_thread.py``). Each ``generate`` starts one
task there (``_pump``) that holds the request's Trio stream (``async with engine.generate``).
The two sides hand over one output at a time: the asyncio reader asks (an asyncio future sent
with ``TrioToken.run_sync_soon``), the pump reads the next output and settles the future with
``loop.call_soon_threadsafe``. While the reader is slow, the request's collector merges the
outputs on the Trio side (no queue grows). Cancellation crosses both ways: an asyncio reader
cancelled (or its generator closed) cancels the pump, whose stream block aborts the request;
an engine failure or shutdown is raised in the asyncio reader.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import trio

from trillm.config import EngineArgs
from trillm.engine.engine_thread import EngineThread
from trillm.engine.llm_control import AsyncLLMControl
from trillm.engine.preprocess import PromptType
from trillm.errors import EngineDeadError
from trillm.outputs import RequestOutput
from trillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine
    from trillm.tokenizer_protocol import Tokenizer

_END = object()  # the stream ended without a final output (cannot happen; closes the reader)


class _Link:
    """One asyncio reader and its Trio pump. Its state is touched on the Trio thread only
    (the asyncio side calls in through ``run_soon``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.scope = trio.CancelScope()
        self.asked: asyncio.Future[Any] | None = None  # the reader's pending ask
        self.asked_event = trio.Event()
        self.error: BaseException | None = None
        self.done = False  # the pump is over: asks get the error or the end

    def ask(self, fut: asyncio.Future[Any]) -> None:
        if self.done:
            self._settle(fut, _END, self.error)
            return
        self.asked = fut
        self.asked_event.set()

    async def next_ask(self) -> asyncio.Future[Any]:
        await self.asked_event.wait()
        self.asked_event = trio.Event()
        fut, self.asked = self.asked, None
        assert fut is not None
        return fut

    def finish(self, error: BaseException | None) -> None:
        """The pump is over; a pending ask (and every later one) gets ``error`` or the end."""
        self.done = True
        self.error = error
        if self.asked is not None:
            fut, self.asked = self.asked, None
            self._settle(fut, _END, error)

    def _settle(self, fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_set_future, fut, value, error)
        except RuntimeError:  # the asyncio loop is closed: nobody is reading any more
            pass

    def settle(self, fut: asyncio.Future[Any], value: Any) -> None:
        self._settle(fut, value, None)


def _set_future(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():  # the reader was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class AsyncLLM(AsyncLLMControl):
    """The engine for asyncio code; see the module docstring (sleep mode, pause and
    collective_rpc: ``llm_control.py``)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """Starts the engine (blocks until it is ready, as vLLM's constructor does)."""
        self._thread = EngineThread(model, engine_args, name="trillm-async-engine")

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        kwargs = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
        model = kwargs.pop("model")
        return cls(model, **kwargs)

    # ------------------------------------------------------------------ status
    @property
    def engine(self) -> AsyncEngine:
        """The Trio ``AsyncEngine`` (read-only use from asyncio: its config, tokenizer)."""
        return self._thread.engine

    @property
    def errored(self) -> bool:
        return self._thread.engine.is_dead or not self._thread.is_alive

    @property
    def dead_error(self) -> BaseException:
        return self._thread.engine.dead_error or EngineDeadError("The engine has shut down.")

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    async def get_tokenizer(self) -> Tokenizer:
        return self._thread.engine.tokenizer

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; ``kwargs``: ``AsyncEngine.generate``'s (priority,
        cache_salt, timeout). Cancelling the reading task, or closing this generator, aborts
        the request; an engine failure is raised here."""
        loop = asyncio.get_running_loop()
        link = _Link(loop)
        thread = self._thread
        thread.spawn(self._pump, link, prompt, sampling_params, request_id, kwargs)
        try:
            while True:
                fut: asyncio.Future[Any] = loop.create_future()
                thread.run_soon(link.ask, fut)
                out = await fut
                if out is _END:
                    return
                yield out
                if out.finished:
                    return
        finally:
            # NOTE: a no-op for a request that finished (its pump is over).
            try:
                thread.run_soon(link.scope.cancel)
            except EngineDeadError:
                pass

    async def _pump(
        self,
        link: _Link,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str | None,
        kwargs: dict[str, Any],
    ) -> None:
        """On the Trio thread: one request's stream, handed over an output per ask."""
        # What the reader gets if this task is cancelled from outside (shutdown).
        error: BaseException | None = EngineDeadError("The engine has shut down.")
        try:
            with link.scope:  # cancelled when the asyncio reader leaves
                stream = self._thread.engine.generate(prompt, params, request_id, **kwargs)
                async with stream as outputs:
                    await self._hand_over(link, outputs)
            error = None
        except Exception as exc:  # the engine failed or refused the request: the reader's
            error = exc
        finally:
            link.finish(error)

    @staticmethod
    async def _hand_over(link: _Link, outputs: AsyncIterator[RequestOutput]) -> None:
        while True:
            fut = await link.next_ask()
            try:
                out = await outputs.__anext__()
            except StopAsyncIteration:  # pragma: no cover - a final output ends the stream
                link.settle(fut, _END)
                return
            except BaseException:
                link.asked = fut  # finish() settles it with the error
                raise
            link.settle(fut, out)
            if out.finished:
                return

    async def abort(self, request_id: str) -> None:
        """Abort a request by id (its reader gets the final 'abort' output)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        engine = self._thread.engine

        async def run() -> None:
            error: BaseException | None = EngineDeadError("The engine has shut down.")
            try:
                await engine.abort(request_id)
                error = None
            except Exception as exc:  # handed to the caller
                error = exc
            finally:
                loop.call_soon_threadsafe(_set_future, done, None, error)

        self._thread.spawn(run)
        await done

    # ------------------------------------------------------------------ life
    def shutdown(self) -> None:
        """Stop the engine, its workers and its thread (blocks until they are gone)."""
        self._thread.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)
