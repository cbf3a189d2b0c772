"""Running a request's generations: ``engine.generate`` read directly (one prompt) or through
producer tasks merged by a channel (several prompts).

One prompt: the handler (or its SSE generator) reads the request stream of
``engine.generate`` directly. Several prompts: one producer task per prompt in the server
nursery (``async with engine.generate(...)`` each), merged through a channel; a disconnect
cancels the producers, whose stream blocks abort their requests. Nothing holds a cancel scope
across a ``yield``. On shutdown the server aborts (``engine.abort``) what outlives
``--shutdown-timeout``; the readers get the engine's final output with ``finish_reason: "abort"``.

Every way out closes a generation deterministically, never through the garbage collector:
``full`` and the SSE body close it in their ``finally``; a streamed body that is never iterated
(the client left before the response started) is closed when its HTTP exchange ends
(``exchange.py``). Closing twice is harmless.

Admission: ``start_generation`` reserves the request's sequences and tokens
(``ServerState.admit``, 503 past ``--max-num-queued-requests`` or ``--max-num-admitted-tokens``)
and the ``Generation`` owns that reservation: ``aclose`` releases it, and ``start_generation``
itself releases it when it is left by any exception or cancellation (a client gone before the
first token) before the Generation reaches its reader. A producer releases its own id when
its engine request ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import trio

from trillm.engine.preprocess import PreparedPrompt
from trillm.engine.request_stream import RequestStream
from trillm.entrypoints.openai.endpoints.base import Admission, ServerState, admitted_tokens
from trillm.entrypoints.openai.http.errors import APIError, from_engine_exception
from trillm.entrypoints.openai.http.exchange import at_exchange_end
from trillm.lora.request import LoRARequest

# NOTE: a small buffer: when the client reads slowly the producer waits and the engine's
# per-request collector merges the deltas, so a slow reader gets fewer, larger chunks.
_CHANNEL_BUFFER = 2


class Generation:
    """One HTTP request's engine requests, read as ``(job_index, RequestOutput | APIError)``.

    ``start_generation`` returns a ``DirectGeneration`` for one prompt (the common case: the
    handler reads the request stream itself, no extra task) and a ``FanInGeneration`` for
    several (one producer task per prompt, merged through a channel).
    """

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop reading; the engine aborts whatever is unfinished. Completes even in a
        cancelled scope; closing again does nothing."""
        raise NotImplementedError


class DirectGeneration(Generation):
    def __init__(self, admission: Admission, request_id: str, stream: RequestStream) -> None:
        self.admission = admission
        self.request_id = request_id
        self.stream = stream
        self.first: Any = None

    async def prime(self) -> None:
        """Submit, then wait for the first output, so admission errors become HTTP errors,
        not SSE events."""
        try:
            await self.stream.__aenter__()
            self.first = await self.stream.__anext__()
        except StopAsyncIteration:  # pragma: no cover - the engine always yields a final output
            self.first = None
        except Exception as exc:
            raise from_engine_exception(exc) from exc
        # (start_generation closes this generation on any way out of here but a return)

    async def __anext__(self) -> tuple[int, Any]:
        if self.first is not None:
            first, self.first = self.first, None
            return 0, first
        try:
            return 0, await self.stream.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:  # the engine failed mid-request
            return 0, from_engine_exception(exc)

    async def aclose(self) -> None:
        self.admission.release_all()
        await self.stream.aclose()  # shielded: aborts the request unless it finished


class FanInGeneration(Generation):
    def __init__(
        self, admission: Admission, receive: trio.MemoryReceiveChannel[tuple[int, Any]]
    ) -> None:
        self.admission = admission
        self.receive = receive
        self.scopes: list[trio.CancelScope] = []  # one per producer started
        self.pending: list[tuple[int, Any]] = []

    async def __anext__(self) -> tuple[int, Any]:
        if self.pending:
            return self.pending.pop(0)
        try:
            return await self.receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def raise_early_error(self) -> None:
        """Raise (as an APIError) a failure the engine reported before any output."""
        while True:
            try:
                item = self.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            if isinstance(item[1], APIError):
                await self.aclose()
                raise item[1]
            self.pending.append(item)

    async def aclose(self) -> None:
        for scope in self.scopes:
            scope.cancel()  # the producers leave their stream blocks, which abort the requests
        # NOTE: closing the channel also ends a producer blocked on send (no reader left).
        self.receive.close()
        self.admission.release_all()


async def start_generation(
    state: ServerState,
    jobs: list[PreparedPrompt],
    request_id: str,
    timeout: float | None = None,  # noqa: ASYNC109 - the request's deadline
    lora_request: LoRARequest | None = None,
) -> Generation:
    """Submit one engine request per prompt, each prepared (checked) by the engine's
    preprocessor: the engine submits it without checking it again.

    Raises the engine's admission errors (a request larger than the KV cache, ...) as
    APIErrors, so they are answered as HTTP errors rather than inside a started stream; 503
    when the queue is full (``--max-num-queued-requests``, ``--max-num-admitted-tokens``).
    ``timeout``: seconds until the request ends with finish_reason "timeout".
    ``lora_request``: the adapter the request's ``model`` names (None: the base model).
    """
    n = jobs[0].params.n
    ids = [request_id] if len(jobs) == 1 else [f"{request_id}-{i}" for i in range(len(jobs))]
    admission = state.admit(ids, n, [admitted_tokens(job) for job in jobs])
    gen: Generation | None = None
    try:
        if len(jobs) == 1:
            stream = state.engine.generate(
                jobs[0], None, request_id, timeout=timeout, lora_request=lora_request
            )
            gen = direct = DirectGeneration(admission, request_id, stream)
            await direct.prime()
            return direct
        send, receive = trio.open_memory_channel[tuple[int, Any]](_CHANNEL_BUFFER)
        gen = fan_in = FanInGeneration(admission, receive)
        job_args = [(prepared, ids[i], timeout, lora_request) for i, prepared in enumerate(jobs)]
        slots = trio.Semaphore(_prompts_at_once(state, n, len(jobs)))
        await state.nursery.start(_launch, fan_in, job_args, slots, send)
        # NOTE: every prompt passed the preprocessor's checks before this; what engine.generate
        # can still refuse without waiting (``task_status.started()`` does not yield, so each
        # producer has run up to its first await) is queued before ``nursery.start`` returned
        # (for the first wave; a later prompt's refusal reaches the reader as its item).
        await fan_in.raise_early_error()
        return fan_in
    except BaseException:
        # Every way out but a return (an engine error, a client gone before the first token,
        # shutdown): nobody else will close what was started.
        if gen is None:
            admission.release_all()
        else:
            with trio.CancelScope(shield=True):
                await gen.aclose()
        raise


def guard_stream(generation: Generation, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``body`` (an SSE generator reading ``generation``); the generation is also closed when
    the HTTP exchange ends, for a body dropped without ever being iterated (a client gone
    before the response started)."""
    at_exchange_end(generation.aclose)
    return body


def _prompts_at_once(state: ServerState, n: int, num_prompts: int) -> int:
    """Fair admission: how many of a request's prompts are in the engine at once. Its
    sequences there stay within ``max_engine_seqs_per_request`` (at least one prompt), so a
    request that arrives later is not queued behind all of it."""
    limit = state.max_engine_seqs_per_request
    if limit is None:
        return num_prompts
    return max(1, min(num_prompts, limit // n))


async def _launch(
    fan_in: FanInGeneration,
    jobs: list[tuple[PreparedPrompt, str, float | None, LoRARequest | None]],
    slots: trio.Semaphore,
    send: trio.MemorySendChannel[tuple[int, Any]],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start one producer per prompt, in order, each once a slot is free (a producer frees its
    slot when its engine request ends). Started (``task_status``) once the first wave is
    submitted; ``fan_in.aclose`` cancels it with the producers, and the ids of the prompts it
    never started are released there (``release_all``). Once the server drains, no further
    prompt is started: the reader gets ``finish_reason: "abort"`` for those.

    The request's ``timeout`` runs from its arrival: a later prompt gets what is left of it."""
    state = fan_in.admission.state
    scope = trio.CancelScope()
    fan_in.scopes.append(scope)
    timeout = jobs[0][2]
    deadline = None if timeout is None else trio.current_time() + timeout
    started = False
    with scope:
        async with send:
            for index, (prepared, rid, _, lora) in enumerate(jobs):
                if not started and slots.value == 0:
                    task_status.started()  # the first wave is in the engine
                    started = True
                await slots.acquire()
                if state.draining:
                    break
                left = None if deadline is None else max(deadline - trio.current_time(), 1e-3)
                job = (prepared, rid, left, lora)
                producer = partial(_produce, fan_in.admission, index, job, send.clone(), slots)
                fan_in.scopes.append(await state.nursery.start(producer))
    if not started:
        task_status.started()


async def _produce(
    admission: Admission,
    index: int,
    job: tuple[PreparedPrompt, str, float | None, LoRARequest | None],
    send: trio.MemorySendChannel[tuple[int, Any]],
    slot: trio.Semaphore,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    rid = job[1]
    scope = trio.CancelScope()
    task_status.started(scope)
    try:
        async with send:
            with scope:
                await _pump(admission.state, index, job, send)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the reader is gone (client disconnected)
    finally:
        admission.release(rid)
        slot.release()


async def _pump(state: ServerState, index: int, job: Any, send: Any) -> None:
    prepared, rid, timeout, lora_request = job
    try:
        async with state.engine.generate(
            prepared, None, rid, timeout=timeout, lora_request=lora_request
        ) as outputs:
            async for out in outputs:
                await send.send((index, out))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise
    except Exception as exc:  # engine failure: hand it to the reader as an HTTP error
        await send.send((index, from_engine_exception(exc)))
