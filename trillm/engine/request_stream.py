"""Stage 4's one submit path: a user request as a parent of its prompts, read in the caller's
task.

    async with engine.generate(prompt, params) as outputs:         # one prompt
        async for out in outputs:
            ...

    async with engine.generate_many(prompts, params) as items:     # several prompts
        async for index, out_or_error in items:
            ...

A ``ParentRequest`` holds a request's prompts (its children). Each child is prepared once
(``Preprocessor.prepare``; a ``PreparedPrompt`` is taken as it is), its grammar compiled, and
submitted as one ``AddRequest`` over the output handler's bounded inbox: the output processor
registers it as one output group of ``n`` samples (``fan_out``: one engine request per sample)
sharing one collector. ``n`` and several prompts are the two levels of one design: samples
of a prompt within its group, prompts within the parent.

Admission: at most ``max_in_flight`` children are in the engine at once (all of them without a
limit); the next is submitted as one finishes, while ``may_start()`` allows (a draining server
says no). The deadline (``timeout``) is the parent's: a child submitted after it passed is
aborted at once, and every "abort" that the deadline caused reads "timeout".

Reading takes outputs from the children's collectors in the caller's own task (no task per
request or prompt), round robin, one scheduling point per output. Leaving the block in any way
(``break``, an exception, a cancellation) aborts every unfinished child under a shield, so
nothing depends on the garbage collector.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import trio

from trillm.engine.output_collector import ReadyQueue, RequestOutputCollector
from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt, PromptType
from trillm.engine.prompt_embeds import inputs_field
from trillm.interfaces import RequestEngine
from trillm.lora.request import LoRARequest
from trillm.messages import AbortRequest, AddRequest, EngineCoreRequest
from trillm.outputs import RequestOutput
from trillm.sampling_params import SamplingParams


@dataclasses.dataclass
class _Child:
    """One prompt of a parent request."""

    index: int
    request_id: str
    prompt: PromptType | PreparedPrompt
    params: SamplingParams | None
    lora: LoRARequest | None
    collector: RequestOutputCollector | None = None  # set once the handler has it
    error: Exception | None = None  # its submission failed (read as its item)
    done: bool = False  # its final output or error was read (or it was aborted)


class ParentRequest:
    """A request of one or more prompts; use it as ``async with engine.generate_many(...)``.
    Items are ``(prompt index, RequestOutput | Exception)``: a prompt's failure is its item,
    the others go on."""

    def __init__(
        self,
        engine: RequestEngine,
        prompts: Sequence[PromptType | PreparedPrompt],
        params: Sequence[SamplingParams | None],
        request_ids: Sequence[str],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's deadline
        lora_requests: Sequence[LoRARequest | None] | None = None,
        max_in_flight: int | None = None,
        may_start: Callable[[], bool] | None = None,
    ) -> None:
        if not prompts or not len(prompts) == len(params) == len(request_ids):
            raise ValueError("A request needs prompts, with one params and one id each.")
        loras = lora_requests if lora_requests is not None else [None] * len(prompts)
        self._children = [
            _Child(i, rid, prompt, p, lora)
            for i, (prompt, p, rid, lora) in enumerate(
                zip(prompts, params, request_ids, loras, strict=True)
            )
        ]
        self._engine = engine
        self._priority = priority
        self._cache_salt = cache_salt
        self._timeout = timeout
        self._max_in_flight = max(1, max_in_flight) if max_in_flight is not None else None
        self._may_start = may_start
        self._deadline = math.inf
        self._expired = False  # the deadline passed: aborts read "timeout"
        self._next = 0  # the next child to submit
        self._in_flight = 0  # children submitted and not done
        self._ready = ReadyQueue()  # children with news (their indexes), in the order it came
        self._entered = False
        self._closed = False

    # ------------------------------------------------------------------ the block
    async def __aenter__(self) -> ParentRequest:
        if self._entered:
            raise RuntimeError("A request can be entered only once.")
        self._entered = True
        self._engine.check_alive()
        self._deadline = _deadline(self._timeout)
        try:
            await self._first_wave()  # its failures are the caller's
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort every unfinished child. Completes even in a cancelled scope; once only."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):  # the handler drains its inbox without waiting
            for child in self._children[: self._next]:
                if child.collector is not None and not child.done:
                    self._finish(child)
                    await self._engine.send_abort(AbortRequest(child.request_id, child.collector))

    # ------------------------------------------------------------------ submitting
    def _may_submit(self) -> bool:
        if self._next >= len(self._children) or self._closed:
            return False
        if self._max_in_flight is not None and self._in_flight >= self._max_in_flight:
            return False
        return self._may_start is None or self._may_start()

    async def _first_wave(self) -> None:
        """The children that may start now, prepared first, then handed over back to back:
        the output handler admits them in one round, so they enter the engine's same step
        (as separate requests sent at once would)."""
        wave: list[tuple[_Child, AddRequest]] = []
        room = len(self._children)
        if self._max_in_flight is not None:
            room = min(room, self._max_in_flight)
        if self._may_start is not None and not self._may_start():
            room = 0
        for child in self._children[:room]:
            wave.append((child, await self._message(child)))
        engine = self._engine
        for child, message in wave:
            if not engine.try_send_to_handler(message):  # the inbox is full: wait for room
                await engine.send_to_handler(message)
            self._next += 1
            await self._sent(child, message)
        await trio.lowlevel.checkpoint()

    async def _submit(self, child: _Child) -> None:
        message = await self._message(child)
        await self._engine.send_to_handler(message)
        await self._sent(child, message)

    async def _sent(self, child: _Child, message: AddRequest) -> None:
        # Set only once the handler has the request: leaving before this aborts nothing.
        child.collector = message.collector
        self._in_flight += 1
        if self._expired:
            await self._engine.send_abort(AbortRequest(child.request_id, message.collector))

    async def _message(self, child: _Child) -> AddRequest:
        """Prepare (unless prepared), check the adapter, compile the grammar: the prompt's
        output group for the output handler."""
        engine = self._engine
        if child.lora is not None:
            await engine.check_lora(child.lora)
        prompt = child.prompt
        if isinstance(prompt, PreparedPrompt):
            prepared = prompt
        else:
            prepared = await engine.preprocessor.prepare(
                prompt,
                child.params or SamplingParams(),
                priority=self._priority,
                cache_salt=self._cache_salt,
            )
        params = prepared.params
        if prepared.mm_items and child.lora is not None:
            raise InvalidRequestError(
                f"A LoRA adapter with {inputs_field(prepared.mm_items)} is not supported yet.",
                "lora_request",
            )
        if params.structured_outputs is not None:
            await engine.compile_grammar(params)
        request = EngineCoreRequest(
            request_id=child.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=params,
            arrival_time=time.monotonic(),
            eos_token_id=engine.preprocessor.eos_token_id,
            priority=prepared.priority,
            cache_salt=prepared.cache_salt,
            extra_hash_keys=([] if child.lora is None else [child.lora.hash_key])
            + [f"mm:{m.modality}:{m.content_hash}" for m in prepared.mm_items],
            lora_request=child.lora,
            mm_items=prepared.mm_items,
        )
        interval = max(engine.stream_interval, prepared.stream_interval or 1)
        collector = RequestOutputCollector(params.output_kind, interval)
        collector.ready_queue = (self._ready, child.index)
        return AddRequest(
            request_id=child.request_id,
            prompt=prepared.text,
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            engine_requests=fan_out(request),
            collector=collector,
            arrival_time=time.time(),
        )

    async def _submit_more(self) -> None:
        """Children finished: start the next ones (a failure is that child's item)."""
        while self._may_submit():
            child = self._children[self._next]
            self._next += 1
            try:
                await self._submit(child)
            except Exception as exc:
                child.error = exc
                self._ready.note(child.index)

    def _finish(self, child: _Child) -> None:
        if not child.done:
            child.done = True
            if child.collector is not None:
                self._in_flight -= 1

    # ------------------------------------------------------------------ reading
    def __aiter__(self) -> ParentRequest:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput | Exception]:
        if not self._entered:
            raise RuntimeError(
                "Read a request's outputs inside `async with engine.generate(...) as outputs:`."
            )
        while True:
            # NOTE: a fresh event before the scan: news arriving after it sets this one.
            self._ready.rearm()
            item = self._take()
            if item is not None:
                if self._children[item[0]].done:
                    await self._submit_more()
                await trio.lowlevel.checkpoint()  # one scheduling point per output
                return item
            if not self._in_flight and not self._ready:
                if self._closed or not self._may_submit():
                    raise StopAsyncIteration
                await self._submit_more()
                continue
            if self._deadline == math.inf or self._expired:
                await self._ready.woken.wait()
                continue
            # NOTE: the deadline's scope covers only the wait, never the caller's work.
            with trio.move_on_at(self._deadline):
                await self._ready.woken.wait()
            if trio.current_time() >= self._deadline:
                await self._expire()

    def _take(self) -> tuple[int, RequestOutput | Exception] | None:
        """The next child with news, in the order the news came."""
        while (index := self._ready.pop()) is not None:
            child = self._children[index]
            if child.done:
                continue
            if child.error is not None:
                self._finish(child)
                return child.index, child.error
            assert child.collector is not None
            try:
                out = child.collector.get_nowait()
            except Exception as exc:  # the engine failed or refused it: nothing to abort
                self._finish(child)
                return child.index, exc
            if out is None:
                continue
            if self._expired:
                for c in out.outputs:
                    if c.finish_reason == "abort":
                        c.finish_reason = "timeout"
            if out.finished:
                self._finish(child)
            elif child.collector.has_error:
                self._ready.note(child.index)  # the error is read next
            return child.index, out
        return None

    async def _expire(self) -> None:
        """The deadline passed: abort the children in the engine; what they produced until
        then is kept, and their final outputs say "timeout"."""
        self._expired = True
        for child in self._children[: self._next]:
            if child.collector is not None and not child.done:
                await self._engine.send_abort(AbortRequest(child.request_id, child.collector))


class RequestStream(ParentRequest):
    """One prompt: ``async with engine.generate(...) as outputs: async for out in outputs``
    reads ``RequestOutput``s, and a failure is raised."""

    def __init__(
        self,
        engine: RequestEngine,
        prompt: PromptType | PreparedPrompt,
        params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's deadline
        lora_request: LoRARequest | None = None,
    ) -> None:
        super().__init__(
            engine,
            [prompt],
            [params],
            [request_id],
            priority=priority,
            cache_salt=cache_salt,
            timeout=timeout,
            lora_requests=[lora_request],
        )
        self.request_id = request_id

    async def __aenter__(self) -> RequestStream:
        await super().__aenter__()
        return self

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:  # type: ignore[override]
        _, out = await super().__anext__()
        if isinstance(out, Exception):
            raise out
        return out


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """n > 1: one engine request per sample (seeded ones get seed + index)."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    children = []
    for index in range(params.n):
        child_params = params.clone()
        child_params.n = 1
        if params.seed is not None:
            # Wrapped into int64: seed 2**63 - 1 with n = 2 stays encodable.
            child_params.seed = (params.seed + index + 2**63) % 2**64 - 2**63
        children.append(
            dataclasses.replace(
                request, request_id=f"{index}_{request.request_id}", sampling_params=child_params
            )
        )
    return children


def _deadline(timeout: float | None) -> float:
    """The Trio clock's deadline for ``timeout`` seconds from now (inf: none)."""
    if timeout is None:
        return math.inf
    if not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidRequestError(f"timeout must be a positive number, got {timeout!r}.", "timeout")
    return trio.current_time() + timeout
