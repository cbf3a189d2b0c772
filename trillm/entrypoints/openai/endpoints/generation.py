"""Running a request's generations: its prompts as one parent request of the engine
(``AsyncEngine.generate_many``, ``trillm/engine/request_stream.py``), read in the handler's
own task (or its SSE generator's) as ``(prompt index, RequestOutput | APIError)``.

``start_generation`` reserves the request's sequences and tokens (``admission.admit``, 503
past ``--max-num-queued-requests`` or ``--max-num-admitted-tokens``), enters the parent
request and waits for its first item, so that what the engine refuses before any output
(a request larger than the KV cache, ...) is an HTTP error, not an SSE event. Fair admission:
at most ``max_engine_seqs_per_request`` of a request's sequences are in the engine at once (at
least one prompt); its next prompt enters as an earlier one ends, and none enters once the
server drains (the reader gets ``finish_reason: "abort"`` for those). The request's
``timeout`` runs from its arrival, for all its prompts.

The ``Generation`` owns the reservation and the parent request (entered through an
``AsyncExitStack``: the stream outlives the handler's frame, so its ``async with`` spans
``start_generation`` to ``aclose``). Every way out closes it deterministically, never through
the garbage collector: ``full`` and the SSE body close it in their ``finally``; a streamed body
that is never iterated (the client left before the response started) is closed when its HTTP
exchange ends (``exchange.py``); ``start_generation`` closes it when it is left by any
exception or cancellation. Closing twice is harmless. On shutdown the server aborts
(``engine.abort``) what outlives ``--shutdown-timeout``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import trio

from trillm.engine.beam_request import BeamSearchRequest
from trillm.engine.preprocess import PreparedPrompt
from trillm.engine.request_stream import ParentRequest
from trillm.entrypoints.openai.endpoints.admission import Admission, admit, admitted_tokens
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.http.errors import APIError, from_engine_exception
from trillm.entrypoints.openai.http.exchange_cleanups import at_exchange_end
from trillm.lora.request import LoRARequest
from trillm.outputs import RequestOutput
from trillm.sampling_params import BeamSearchParams


class Generation:
    """One HTTP request's prompts in the engine, read as ``(prompt index, RequestOutput |
    APIError)``; a prompt's failure is its item, the others go on."""

    def __init__(
        self,
        admission: Admission,
        request_ids: list[str],
        request: ParentRequest | BeamSearchRequest,
    ):
        self.admission = admission
        self.request_ids = request_ids
        self.request = request
        self._stack = AsyncExitStack()
        self._first: tuple[int, RequestOutput | APIError] | None = None

    async def start(self) -> None:
        """Submit, then wait for the first item: a failure before any output is raised (an
        APIError: an HTTP error rather than an SSE event)."""
        try:
            await self._stack.enter_async_context(self.request)
            first = await self._next()
        except StopAsyncIteration:  # pragma: no cover - the engine always yields a final output
            return
        except APIError:
            raise
        except Exception as exc:
            raise from_engine_exception(exc) from exc
        if isinstance(first[1], APIError):
            raise first[1]
        self._first = first

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput | APIError]:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._next()

    async def _next(self) -> tuple[int, RequestOutput | APIError]:
        index, out = await self.request.__anext__()
        if isinstance(out, Exception):  # this prompt failed: an HTTP error for the reader
            self.admission.release(self.request_ids[index])
            return index, from_engine_exception(out)
        if out.finished:
            self.admission.release(self.request_ids[index])
        return index, out

    async def aclose(self) -> None:
        """Stop reading; the engine aborts whatever is unfinished. Completes even in a
        cancelled scope; closing again does nothing."""
        self.admission.release_all()
        with trio.CancelScope(shield=True):
            await self._stack.aclose()


async def start_generation(
    state: ServerState,
    jobs: list[PreparedPrompt],
    request_id: str,
    timeout: float | None = None,  # noqa: ASYNC109 - the request's deadline
    lora_request: LoRARequest | None = None,
    beam: BeamSearchParams | None = None,
    stream_interval: int | None = None,
) -> Generation:
    """Submit the request's prompts, each prepared (checked) by the engine's preprocessor: the
    engine submits them without checking them again.

    Raises the engine's admission errors (a request larger than the KV cache, ...) as
    APIErrors, so they are answered as HTTP errors rather than inside a started stream; 503
    when the queue is full (``--max-num-queued-requests``, ``--max-num-admitted-tokens``).
    ``timeout``: seconds until the request ends with finish_reason "timeout".
    ``lora_request``: the adapter the request's ``model`` names (None: the base model).
    ``beam``: a beam search of the prompts instead (``use_beam_search``), admitted as ``n``
    sequences each; its items come when the search is over.
    ``stream_interval``: the request's (vLLM's field), raising --stream-interval for it.
    """
    for job in jobs:
        job.stream_interval = stream_interval
    n = jobs[0].params.n
    ids = [request_id] if len(jobs) == 1 else [f"{request_id}-{i}" for i in range(len(jobs))]
    admission = admit(state, ids, n, [admitted_tokens(job) for job in jobs])
    try:
        request: ParentRequest | BeamSearchRequest
        if beam is not None:
            request = _beam_search(state, jobs, beam, ids, timeout, lora_request)
        else:
            request = state.engine.generate_many(
                jobs,
                None,
                ids,
                timeout=timeout,
                lora_requests=[lora_request] * len(jobs),
                max_in_flight=_prompts_at_once(state, n, len(jobs)),
                may_start=state.accepts_prompts,
            )
    except BaseException:
        admission.release_all()
        raise
    gen = Generation(admission, ids, request)
    try:
        await gen.start()
    except BaseException:
        # Every way out but a return (an engine error, a client gone before the first token,
        # shutdown): nobody else will close what was started.
        with trio.CancelScope(shield=True):
            await gen.aclose()
        raise
    return gen


def raise_if_error(item: RequestOutput | APIError) -> RequestOutput:
    """A generation's item as its output; a prompt's failure raised as its APIError."""
    if isinstance(item, APIError):
        raise item
    return item


def guard_stream(generation: Generation, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``body`` (an SSE generator reading ``generation``); the generation is also closed when
    the HTTP exchange ends, for a body dropped without ever being iterated (a client gone
    before the response started)."""
    at_exchange_end(generation.aclose)
    return body


def _beam_search(
    state: ServerState,
    jobs: list[PreparedPrompt],
    beam: BeamSearchParams,
    ids: list[str],
    timeout: float | None,  # noqa: ASYNC109 - the request's deadline
    lora_request: LoRARequest | None,
) -> BeamSearchRequest:
    try:
        return BeamSearchRequest(
            state.engine,
            jobs,
            beam,
            ids,
            timeout=timeout,
            lora_requests=[lora_request] * len(jobs),
            max_in_flight=state.max_engine_seqs_per_request,  # beams: one sequence each
            may_start=state.accepts_prompts,
        )
    except ValueError as exc:  # what the search cannot serve (its width, images): a 400
        raise from_engine_exception(exc) from exc


def _prompts_at_once(state: ServerState, n: int, num_prompts: int) -> int:
    """Fair admission: how many of a request's prompts are in the engine at once. Its
    sequences there stay within ``max_engine_seqs_per_request`` (at least one prompt), so a
    request that arrives later is not queued behind all of it."""
    limit = state.max_engine_seqs_per_request
    if limit is None:
        return num_prompts
    return max(1, min(num_prompts, limit // n))
