"""Stage 4's reader side: one request's outputs as a stream that Trio owns.

    async with engine.generate(prompt, params) as outputs:
        async for out in outputs:
            ...

``__aenter__`` prepares the prompt (when it is not a ``PreparedPrompt`` already), compiles a
structured-output grammar, and sends one ``AddRequest`` over the output handler's bounded
inbox: the handler registers the request in the output processor (which only it mutates) and
submits the engine requests. Reading takes the outputs from the request's collector in the
caller's own task (no task per request). Leaving the block in any way before the final output
(``break``, an exception, a cancellation) sends an ``AbortRequest`` under a shield, so the
request is aborted at once and never depends on the garbage collector.
"""

from __future__ import annotations

import math
import time
from types import TracebackType
from typing import Protocol

import trio

from trillm.engine.output_collector import RequestOutputCollector
from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt, Preprocessor, PromptType
from trillm.lora.request import LoRARequest
from trillm.messages import AbortRequest, AddRequest, EngineCoreRequest
from trillm.outputs import RequestOutput
from trillm.sampling_params import SamplingParams


class StreamEngine(Protocol):
    """What a stream needs of ``AsyncEngine`` (named here: no import cycle)."""

    preprocessor: Preprocessor
    stream_interval: int

    def check_alive(self) -> None: ...

    async def check_lora(self, lora: LoRARequest) -> None: ...

    async def compile_grammar(self, params: SamplingParams) -> None: ...

    async def send_to_handler(self, msg: AddRequest) -> None: ...

    async def send_abort(self, msg: AbortRequest) -> None: ...


class RequestStream:
    """One request; use it only as ``async with engine.generate(...) as outputs``."""

    def __init__(
        self,
        engine: StreamEngine,
        prompt: PromptType | PreparedPrompt,
        params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's deadline
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self._engine = engine
        self._prompt = prompt
        self._params = params
        self._priority = priority
        self._cache_salt = cache_salt
        self._timeout = timeout
        self._lora = lora_request
        self._deadline = math.inf
        self._collector: RequestOutputCollector | None = None
        self._finished = False  # the final output was read (or the request failed)

    # ------------------------------------------------------------------ the block
    async def __aenter__(self) -> RequestStream:
        if self._collector is not None:
            raise RuntimeError("A request stream can be entered only once.")
        engine = self._engine
        engine.check_alive()
        self._deadline = _deadline(self._timeout)
        lora = self._lora
        if lora is not None:
            await engine.check_lora(lora)
        prompt = self._prompt
        if isinstance(prompt, PreparedPrompt):
            prepared = prompt
        else:
            prepared = await engine.preprocessor.prepare(
                prompt,
                self._params or SamplingParams(),
                priority=self._priority,
                cache_salt=self._cache_salt,
            )
        params = prepared.params
        if params.structured_outputs is not None:
            await engine.compile_grammar(params)
        request = EngineCoreRequest(
            request_id=self.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=params,
            arrival_time=time.monotonic(),
            eos_token_id=engine.preprocessor.eos_token_id,
            priority=prepared.priority,
            cache_salt=prepared.cache_salt,
            extra_hash_keys=[] if lora is None else [lora.hash_key],
            lora_request=lora,
        )
        collector = RequestOutputCollector(params.output_kind, engine.stream_interval)
        message = AddRequest(
            request_id=self.request_id,
            prompt=prepared.text,
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            engine_requests=fan_out(request),
            collector=collector,
            arrival_time=time.time(),
        )
        await engine.send_to_handler(message)
        # Set only once the handler has the request: leaving before this aborts nothing.
        self._collector = collector
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort the request unless it finished. Completes even in a cancelled scope."""
        if self._collector is None or self._finished:
            return
        self._finished = True
        with trio.CancelScope(shield=True):  # the handler drains its inbox without waiting
            await self._engine.send_abort(AbortRequest(self.request_id, self._collector))

    # ------------------------------------------------------------------ reading
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        collector = self._collector
        if collector is None:
            raise RuntimeError(
                "Read a request's outputs inside `async with engine.generate(...) as outputs:`."
            )
        if self._finished:
            raise StopAsyncIteration
        try:
            if self._deadline == math.inf:  # (no cancel scope on the common path)
                out = await collector.get()
            else:
                # NOTE: the deadline's scope covers only the wait, never the caller's work.
                got: RequestOutput | None = None
                with trio.move_on_at(self._deadline):
                    got = await collector.get()
                out = got or await self._expire(collector)
        except Exception:
            self._finished = True  # the engine failed or refused it: nothing left to abort
            raise
        if out.finished:
            self._finished = True
        return out

    async def _expire(self, collector: RequestOutputCollector) -> RequestOutput:
        """The deadline passed: abort; the final output says "timeout" where it says "abort"
        (what the request produced until then is kept)."""
        await self._engine.send_abort(AbortRequest(self.request_id, collector))
        out = await collector.get()
        for c in out.outputs:
            if c.finish_reason == "abort":
                c.finish_reason = "timeout"
        return out


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """n > 1: one engine request per sample (seeded ones get seed + index)."""
    import dataclasses

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
