"""What the chat and completion endpoints share: server state, running generations in the
server's nursery, building SamplingParams from a request, usage and logprob formatting.

One prompt: the handler (or its SSE generator) iterates ``engine.generate`` directly. A client
disconnect cancels the handler or closes the SSE generator; either way ``engine.generate`` is
left (explicitly closed, never left to the garbage collector) and aborts the request in the
engine. Several prompts: one producer task per prompt in the server nursery, merged through a
channel; a disconnect cancels the producers. Nothing holds a cancel scope across a ``yield``.
On shutdown the server aborts (``engine.abort``) what outlives ``--shutdown-timeout``; the
readers get the engine's final output with ``finish_reason: "abort"``.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import attrs
import trio

from trillm.entrypoints.openai.errors import (
    APIError,
    BadRequestError,
    NotFoundError,
    from_engine_exception,
)
from trillm.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from trillm.entrypoints.openai.protocol import MAX_STOP_STRING_LEN
from trillm.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)

# generation_config.json keys that become request defaults (vLLM's list).
_CHANNEL_BUFFER = 2
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@attrs.define(eq=False)
class ServerState:
    engine: Any
    served_model_names: list[str]
    metrics: ServerMetrics
    nursery: trio.Nursery
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    max_logprobs: int = 20
    draining: bool = False
    # Engine request ids in flight: shutdown aborts those that outlive --shutdown-timeout.
    inflight: set[str] = attrs.field(factory=set)
    drained: trio.Event = attrs.field(factory=trio.Event)  # set once draining and none in flight
    _token_text: dict[int, str] = attrs.field(factory=dict)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")

    def track(self, request_id: str) -> None:
        self.inflight.add(request_id)

    def untrack(self, request_id: str) -> None:
        self.inflight.discard(request_id)
        if self.draining and not self.inflight:
            self.drained.set()

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


# ---------------------------------------------------------------- running generations


class Generation:
    """One HTTP request's engine requests, read as ``(job_index, RequestOutput | APIError)``.

    ``start_generation`` returns a ``DirectGeneration`` for one prompt (the common case: the
    handler iterates ``engine.generate`` itself, no extra task) and a ``FanInGeneration`` for
    several (one producer task per prompt, merged through a channel).
    """

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop reading; the engine aborts whatever is unfinished. Does not block."""
        raise NotImplementedError

    def close_when_dropped(self) -> None:
        """Cleanup for a reader dropped without ``aclose`` (never-started response body)."""


class DirectGeneration(Generation):
    def __init__(self, state: ServerState, request_id: str, outputs: AsyncIterator[Any]) -> None:
        self.state = state
        self.request_id = request_id
        self.outputs = outputs
        self.first: Any = None

    async def prime(self) -> None:
        """Wait for the first output, so admission errors become HTTP errors, not SSE events."""
        try:
            self.first = await self.outputs.__anext__()
        except StopAsyncIteration:  # pragma: no cover - the engine always yields a final output
            self.first = None
        except Exception as exc:
            await self.aclose()
            raise from_engine_exception(exc) from exc

    async def __anext__(self) -> tuple[int, Any]:
        if self.first is not None:
            first, self.first = self.first, None
            return 0, first
        try:
            return 0, await self.outputs.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:  # the engine failed mid-request
            return 0, from_engine_exception(exc)

    async def aclose(self) -> None:
        self.state.untrack(self.request_id)
        # NOTE: engine.generate's cleanup is synchronous (it queues the abort), so this
        # completes even inside a cancelled scope.
        await self.outputs.aclose()  # type: ignore[attr-defined]

    def close_when_dropped(self) -> None:
        # Trio's async-generator finalizer closes engine.generate (and so aborts it).
        self.state.untrack(self.request_id)


class FanInGeneration(Generation):
    def __init__(
        self, receive: trio.MemoryReceiveChannel[tuple[int, Any]], scopes: list[trio.CancelScope]
    ) -> None:
        self.receive = receive
        self.scopes = scopes
        self.pending: list[tuple[int, Any]] = []

    async def __anext__(self) -> tuple[int, Any]:
        if self.pending:
            return self.pending.pop(0)
        try:
            return await self.receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def raise_early_error(self) -> None:
        """Raise (as an APIError) a failure the engine reported before any output."""
        while True:
            try:
                item = self.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            if isinstance(item[1], APIError):
                self.close_when_dropped()
                raise item[1]
            self.pending.append(item)

    async def aclose(self) -> None:
        self.close_when_dropped()

    def close_when_dropped(self) -> None:
        for scope in self.scopes:
            scope.cancel()  # the producers leave engine.generate, which aborts the requests
        self.receive.close()


async def start_generation(
    state: ServerState,
    jobs: list[tuple[list[int], SamplingParams]],
    request_id: str,
    priority: int,
    cache_salt: str | None,
) -> Generation:
    """Submit one engine request per ``(prompt_token_ids, params)`` job.

    Raises the engine's admission errors (a request larger than the KV cache, ...) as
    APIErrors, so they are answered as HTTP errors rather than inside a started stream.
    """
    if len(jobs) == 1:
        ids, params = jobs[0]
        outputs = state.engine.generate(
            {"prompt_token_ids": ids}, params, request_id, priority=priority, cache_salt=cache_salt
        )
        state.track(request_id)
        direct = DirectGeneration(state, request_id, outputs)
        await direct.prime()
        return direct
    # NOTE: a small buffer: when the client reads slowly the producer waits and the engine's
    # per-request collector merges the deltas, so a slow reader gets fewer, larger chunks.
    send, receive = trio.open_memory_channel[tuple[int, Any]](_CHANNEL_BUFFER)
    scopes = []
    async with send:
        for i, (ids, params) in enumerate(jobs):
            job = (ids, params, f"{request_id}-{i}", priority, cache_salt)
            scopes.append(await state.nursery.start(_produce, state, i, job, send.clone()))
    fan_in = FanInGeneration(receive, scopes)
    # NOTE: ``task_status.started()`` does not yield, so each producer has run
    # engine.generate's synchronous admission checks (and queued any failure) before
    # ``nursery.start`` returned.
    fan_in.raise_early_error()
    return fan_in


def guard_stream(generation: Generation, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``body`` (an SSE generator reading ``generation``), cleaning the generation up if the
    body is dropped without ever being iterated (a client gone before the response started)."""
    weakref.finalize(body, generation.close_when_dropped)
    return body


async def _produce(
    state: ServerState,
    index: int,
    job: tuple[list[int], SamplingParams, str, int, str | None],
    send: trio.MemorySendChannel[tuple[int, Any]],
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    ids, params, rid, priority, cache_salt = job
    scope = trio.CancelScope()
    state.track(rid)
    task_status.started(scope)
    try:
        async with send:
            with scope:
                await _pump(state, index, {"prompt_token_ids": ids}, params, rid, priority,
                            cache_salt, send)  # fmt: skip
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the reader is gone (client disconnected)
    finally:
        state.untrack(rid)


async def _pump(state, index, prompt, params, rid, priority, cache_salt, send) -> None:  # type: ignore[no-untyped-def]
    try:
        gen = state.engine.generate(prompt, params, rid, priority=priority, cache_salt=cache_salt)
        async with aclosing(gen) as outputs:
            async for out in outputs:
                await send.send((index, out))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise
    except Exception as exc:  # engine failure: hand it to the reader as an HTTP error
        await send.send((index, from_engine_exception(exc)))


# ---------------------------------------------------------------- sampling parameters


def resolve_max_tokens(
    state: ServerState, requested: int | None, prompt_len: int, param: str = "max_tokens"
) -> int:
    """``requested`` checked against the context, or what is left of it when None."""
    max_len = state.model_config.max_model_len
    if prompt_len >= max_len:
        raise BadRequestError(
            f"This model's maximum context length is {max_len} tokens. However, your request "
            f"has {prompt_len} input tokens, leaving no room for output. Please reduce the "
            "length of the input.",
            "messages" if param == "max_completion_tokens" else "prompt",
        )
    room = max_len - prompt_len
    if requested is None:
        default = state.model_config.generation_config.get("max_new_tokens")
        return min(room, default) if isinstance(default, int) and default > 0 else room
    if requested > room:
        raise BadRequestError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the input, {requested} in the "
            f"completion). Please reduce the length of the input or {param}.",
            param,
        )
    return requested


def build_sampling_params(
    state: ServerState, req: Any, *, max_tokens: int, logprobs: int | None, n: int | None = None
) -> SamplingParams:
    """The request's sampling fields with the model's generation_config as defaults."""
    defaults = {
        k: v
        for k, v in (state.model_config.generation_config or {}).items()
        if k in _GENERATION_DEFAULTS and v is not None
    }

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    _check_stop(req.stop)
    kwargs = dict(
        n=n if n is not None else req.n,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0),
        min_p=pick("min_p", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=_logit_bias(req.logit_bias),
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=_structured_outputs(req),
    )
    try:
        params = SamplingParams(**kwargs)
        params.verify_vocab(state.model_config.vocab_size, state.max_logprobs)
    except SamplingParamsError as exc:
        raise BadRequestError(str(exc), exc.param) from exc
    return params


def _check_stop(stop: str | list[str] | None) -> None:
    for s in [stop] if isinstance(stop, str) else stop or []:
        if not s:
            raise BadRequestError("'stop' strings must not be empty.", "stop")
        if len(s) > MAX_STOP_STRING_LEN:
            raise BadRequestError(
                f"'stop' strings are limited to {MAX_STOP_STRING_LEN} characters, got {len(s)}.",
                "stop",
            )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise BadRequestError(
                f"'logit_bias' keys must be token ids, got {key!r}.", "logit_bias"
            ) from None
    return out


def _structured_outputs(req: Any) -> StructuredOutputsParams | None:
    so = req.structured_outputs
    if so is not None:
        chosen = {k: v for k, v in attrs.asdict(so, recurse=False).items() if v is not None}
        if len(chosen) != 1:
            raise BadRequestError(
                "'structured_outputs' must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {sorted(chosen) or 'none'}.",
                "structured_outputs",
            )
        return StructuredOutputsParams(**chosen)
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise BadRequestError(
            "'response_format.json_schema.schema' is required when type is 'json_schema'.",
            "response_format.json_schema",
        )
    return StructuredOutputsParams(json=fmt.json_schema.schema)


# ---------------------------------------------------------------- outputs


@attrs.define(eq=False)
class ChoiceState:
    """Accumulated output of one choice (non-streaming) or its bookkeeping (streaming)."""

    index: int
    texts: list[str] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: Any) -> None:
        if c.text:
            self.texts.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason = str(c.finish_reason)
            self.stop_reason = c.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


class RequestTracker:
    """Per-request counters for usage and metrics across its prompts and choices."""

    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens", "timer", "reasons")

    def __init__(self, state: ServerState, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: dict[int, int] = {}  # job index -> prompt tokens from the cache
        self.completion_tokens = 0
        self.timer = RequestTimer(state.metrics, time.perf_counter())
        self.reasons: list[str] = []

    def observe(self, out: Any, job: int = 0) -> None:
        count = 0
        for c in out.outputs:
            count += len(c.token_ids)
            if c.finish_reason is not None:
                self.reasons.append(str(c.finish_reason))
        self.completion_tokens += count
        self.timer.tokens(time.perf_counter(), count)
        if out.num_cached_tokens:
            self.cached_tokens[job] = out.num_cached_tokens

    def finish(self, num_choices: int) -> None:
        missing = num_choices - len(self.reasons)
        self.reasons.extend(["abort"] * max(missing, 0))
        self.timer.finished(time.perf_counter(), self.prompt_tokens, self.reasons)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }


def raise_if_error(item: Any) -> Any:
    if isinstance(item, APIError):
        raise item
    return item


def position_logprobs(state: ServerState, entry: Any, token_id: int) -> tuple[float, list]:
    """One position's logprobs: the chosen token's value and ``[(id, text, logprob)]`` by rank.

    ``entry`` maps token id -> Logprob (``.logprob``, ``.rank``) or a float.
    """
    ranked = []
    chosen = -math.inf
    for tid, lp in entry.items():
        value = float(getattr(lp, "logprob", lp))
        if tid == token_id:
            chosen = value
        ranked.append(
            (getattr(lp, "rank", None) or 0, tid, value, getattr(lp, "decoded_token", None))
        )
    ranked.sort(key=lambda r: (r[0] if r[0] else math.inf, -r[2]))
    tops = [(tid, text if text is not None else state.token_text(tid), value)
            for _, tid, value, text in ranked]  # fmt: skip
    return chosen, tops


def prompt_logprobs_json(state: ServerState, prompt_logprobs: Any) -> list | None:
    """vLLM's shape: ``[null | {token_id: {logprob, rank, decoded_token}}]`` per prompt token."""
    if prompt_logprobs is None:
        return None
    out: list[Any] = []
    for entry in prompt_logprobs:
        if entry is None:
            out.append(None)
            continue
        out.append(
            {
                str(tid): {
                    "logprob": float(getattr(lp, "logprob", lp)),
                    "rank": getattr(lp, "rank", None),
                    "decoded_token": getattr(lp, "decoded_token", None) or state.token_text(tid),
                }
                for tid, lp in entry.items()
            }
        )
    return out


async def tokenize_text(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    encode = state.tokenizer.encode
    if len(text) < 20_000:
        return list(encode(text, add_special_tokens=add_special_tokens))
    # NOTE: long prompts are tokenized off the event loop so streams keep flowing.
    return list(
        await trio.to_thread.run_sync(lambda: encode(text, add_special_tokens=add_special_tokens))
    )


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    vocab = state.model_config.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise BadRequestError(
                f"Token id {t} in '{param}' is outside the vocabulary [0, {vocab}).", param
            )
