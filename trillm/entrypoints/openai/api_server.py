"""The OpenAI-compatible HTTP server: the quart-trio app and the root nursery around it.

Root nursery shape (DESIGN.md)::

    trio.run(run_server)
      signal watcher                    SIGINT/SIGTERM -> drain, then stop
      engine supervisor                 open_engine(...) (engine-core + output handler inside);
                                        on its death: exit 1, or a new engine (engine_supervisor)
      server nursery
        hypercorn.trio.serve(app)       started with nursery.start: listening once it returns
        producers                       one task per in-flight engine request (generation)

The HTTP listener starts only after the engine is ready, so ``/health`` answers 200 from the
first connection; it answers 503 once the engine has died or the server is draining. The
engine is closed only after the HTTP server has stopped.
"""

from __future__ import annotations

import hmac
import logging
import signal
import socket
from functools import partial
from typing import Any

import attrs
import orjson
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

import trillm
from trillm.engine.output_processor import DEFAULT_WAKE_BUDGET
from trillm.entrypoints.openai import extra_routes, openapi, serving_lora, vllm_flags
from trillm.entrypoints.openai.engine_supervisor import supervise_engine
from trillm.entrypoints.openai.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    UnsupportedMediaTypeError,
    error_body,
    internal_error,
)
from trillm.entrypoints.openai.exchange import CloseAtExchangeEnd
from trillm.entrypoints.openai.http_listener import (
    hypercorn_config,
    hypercorn_serve,
    reserve_listener,
)
from trillm.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from trillm.entrypoints.openai.metrics import ServerMetrics
from trillm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    structure_body,
)
from trillm.entrypoints.openai.protocol_embedding import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
)
from trillm.entrypoints.openai.serving_base import ServerState, max_prompt_chars
from trillm.entrypoints.openai.serving_classify import create_classification
from trillm.entrypoints.openai.serving_embedding import create_embedding
from trillm.entrypoints.openai.serving_tokenize import detokenize, tokenize
from trillm.entrypoints.openai.stats_logger import log_stats_periodically

logger = logging.getLogger("trillm.server")

MAX_BODY_BYTES = 16 * 1024 * 1024
RETRY_AFTER_S = 1  # the Retry-After of a 503
# After --shutdown-timeout and the aborts, what still runs (a producer nobody reads) gets
# this long before it is cancelled: shutdown never hangs.
SHUTDOWN_BACKSTOP_S = 10.0
_OPEN_PATHS = ("/health", "/ping", "/load", "/metrics", "/version", "/openapi.json")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---------------------------------------------------------------- the app


def build_app(
    state: ServerState, api_key: str | None = None, log_requests_max_len: int | None = None
) -> QuartTrio:
    """``log_requests_max_len``: --enable-log-requests with --max-log-len (None: no log)."""
    app = QuartTrio("trillm")
    app.config.update(
        MAX_CONTENT_LENGTH=MAX_BODY_BYTES,
        RESPONSE_TIMEOUT=None,  # streams last as long as generation does
        BODY_TIMEOUT=60,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    _install_gate(app, state, api_key)
    _install_error_handlers(app)
    log = None if log_requests_max_len is None else extra_routes.RequestLog(log_requests_max_len)
    _install_routes(app, state, extra_routes.Dispatcher(state, result_response, log))
    # What a stream whose body never ran holds is released when its exchange ends.
    app.asgi_app = CloseAtExchangeEnd(app.asgi_app)  # type: ignore[method-assign,assignment]
    return app


def _install_gate(app: QuartTrio, state: ServerState, api_key: str | None) -> None:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @app.before_request
    async def gate() -> None:
        path = request.path
        if expected is not None and path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise AuthenticationError("Invalid or missing API key.")
        if path in _OPEN_PATHS:
            return
        if state.draining:
            raise ServiceUnavailableError("The server is shutting down.")
        if state.engine.is_dead:
            raise ServiceUnavailableError(f"The engine is not available: {state.engine.dead_error}")
        if request.method == "POST" and path.startswith("/v1/"):
            # A full queue refuses before the body is read; start_generation checks again
            # with the request's real size (prompts x n).
            state.check_capacity()

    @app.after_request
    async def retry_after(response: Response) -> Response:
        # NOTE: every 503 here is transient (overload, shutdown, an engine being replaced):
        # tell clients and load balancers when to come back.
        if response.status_code == 503 and "Retry-After" not in response.headers:
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response


def _install_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(err: APIError) -> Response:
        return json_response(err.body(), err.status)

    @app.errorhandler(HTTPException)
    async def http_error(err: HTTPException) -> Response:
        code = err.code or 500
        kind = {404: NotFoundError, 405: MethodNotAllowedError, 413: PayloadTooLargeError}.get(
            code, BadRequestError if 400 <= code < 500 else InternalServerError
        )
        message = {
            404: f"No route {request.path}.",
            413: f"The request body is larger than {MAX_BODY_BYTES} bytes.",
        }.get(code, err.description or err.name)
        return json_response(error_body(message, kind.type, None, code), code)

    @app.errorhandler(Exception)
    async def unhandled(err: Exception) -> Response:
        logger.error("Unhandled error in %s %s", request.method, request.path)
        api_error = internal_error(err)
        return json_response(api_error.body(), api_error.status)


def _install_routes(app: QuartTrio, state: ServerState, run: extra_routes.Dispatcher) -> None:
    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return await run.chat(await json_body())

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await run.completion(await json_body())

    @app.get("/v1/models")
    async def models() -> Response:
        cards = model_cards(state)
        if state.loras is not None:
            cards += state.loras.cards()
        return json_response({"object": "list", "data": cards})

    if state.loras is not None and state.loras.allow_updates:
        loras = state.loras

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter() -> Response:
            text = await serving_lora.load_adapter(loras, state.engine, await json_body())
            return Response(text, 200, content_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter() -> Response:
            text = serving_lora.unload_adapter(loras, state.engine, await json_body())
            return Response(text, 200, content_type="text/plain")

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        body = await json_body()
        req = await structure_body(EmbeddingRequest, body, request.content_length)
        return json_response(await create_embedding(state, req))

    @app.post("/pooling")
    async def pooling() -> Response:
        body = await json_body()
        req = await structure_body(PoolingRequest, body, request.content_length)
        return json_response(await create_embedding(state, req))

    @app.post("/classify")
    async def classify() -> Response:
        body = await json_body()
        req = await structure_body(ClassificationRequest, body, request.content_length)
        return json_response(await create_classification(state, req))

    @app.post("/tokenize")
    async def tokenize_route() -> Response:
        body = await json_body()
        req = await structure_body(TokenizeRequest, body, request.content_length)
        return json_response(await tokenize(state, req))

    @app.post("/detokenize")
    async def detokenize_route() -> Response:
        body = await json_body()
        req = await structure_body(DetokenizeRequest, body, request.content_length)
        return json_response(await detokenize(state, req))

    @app.get("/health")
    async def health() -> Response:
        engine = state.engine
        if state.draining or engine.is_dead or not engine.is_running:
            err = ServiceUnavailableError("The server is not ready or shutting down.")
            return json_response(err.body(), err.status)
        return Response(b"", 200)

    extra_routes.install(app, state, run, json_body, health, json_response)  # /ping, ...

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": trillm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return json_response(openapi.build_spec())


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    cfg = state.model_config
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "trillm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
        }
        for name in state.served_model_names
    ]


async def json_body() -> Any:
    """The request body as decoded JSON (an object), or a 400/413 APIError."""
    mimetype = request.mimetype
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise UnsupportedMediaTypeError(
            f"Content-Type must be application/json, got {mimetype or 'none'!r}."
        )
    data = await request.get_data(cache=False)  # 413 (HTTPException) beyond MAX_CONTENT_LENGTH
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    return body


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, content_type="application/json")


def result_response(result: Any) -> Response:
    if isinstance(result, dict):
        return json_response(result)
    response = Response(result, 200, content_type="text/event-stream", headers=_SSE_HEADERS)
    response.timeout = None
    return response


# ---------------------------------------------------------------- the process


@attrs.define
class ServerOptions:
    """What ``trillm serve`` needs beyond EngineArgs."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    served_model_names: list[str] | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    max_logprobs: int = 20
    log_level: str = "info"
    shutdown_timeout: float = 30.0
    # Seconds an idle keep-alive connection stays open (--timeout-keep-alive).
    keep_alive_timeout: float = 5.0
    # Streams woken per engine step for a middle chunk (None: every stream, every step).
    stream_wake_budget: int | None = DEFAULT_WAKE_BUDGET
    # Tool calling and reasoning (issue 12; cli_args._add_tool_flags).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None
    # Requests waiting beyond the running batch (--max-num-seqs); past it, 503 at once.
    max_num_queued_requests: int | None = None
    # Tokens admitted at once (prompt + max_tokens per sequence); past it, 503 at once.
    max_num_admitted_tokens: int | None = None
    # On the engine's death: a new engine in the same process (else exit code 1).
    restart_on_engine_death: bool = False
    # vLLM's deployment flags (issue 16; vllm_flags.py): TLS, CORS, proxy, logs, metrics.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    allowed_origins: list[str] = attrs.field(factory=lambda: ["*"])
    allowed_methods: list[str] = attrs.field(factory=lambda: ["*"])
    allowed_headers: list[str] = attrs.field(factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str = ""
    enable_log_requests: bool = False
    max_log_len: int = 256
    log_stats: bool = True
    log_stats_interval: float = 10.0
    metrics_prefix: str = "both"
    # LoRA adapters served by name (--lora-modules: serving_lora.LoRAModulePath), and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter exist.
    lora_modules: list[Any] = attrs.field(factory=list)
    allow_runtime_lora_updating: bool = False


@attrs.define(eq=False)
class _Lifecycle:
    stop: trio.Event = attrs.field(factory=trio.Event)
    serving: bool = False
    exit_code: int = 0  # 1 once the engine has died


async def run_server(model: str | None, engine_args: dict[str, Any], opts: ServerOptions) -> int:
    """Bind the address (PortUnavailableError, before anything loads), load the engine, serve
    until SIGINT/SIGTERM (or the engine's death), drain; return the exit code (0, or 1 when the
    engine died)."""
    life = _Lifecycle()
    listener = reserve_listener(opts.host, opts.port)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as root:
                root.start_soon(_watch_signals, signals, life, root.cancel_scope)
                await _serve(model, engine_args, opts, life, listener)
                root.cancel_scope.cancel()
    finally:
        listener.close()  # a no-op once hypercorn took it over (detached)
    return life.exit_code


async def _watch_signals(signals: Any, life: _Lifecycle, root: trio.CancelScope) -> None:
    async for signum in signals:
        logger.info("Received %s.", signal.Signals(signum).name)
        if not life.serving or life.stop.is_set():
            root.cancel()  # still loading, or a second signal: stop now
            return
        life.stop.set()


async def _serve(
    model: str | None,
    engine_args: dict[str, Any],
    opts: ServerOptions,
    life: _Lifecycle,
    listener: socket.socket,
) -> None:
    from trillm.engine.async_engine import open_engine

    # NOTE: the engine's preprocessor owns the chat template (stage 2), for HTTP and Python.
    opener = partial(
        open_engine, model, stream_wake_budget=opts.stream_wake_budget,
        chat_template=opts.chat_template, **engine_args,
    )  # fmt: skip
    done = trio.Event()  # the HTTP server has stopped: the engine may go
    async with trio.open_nursery() as engines:
        engine = await engines.start(
            supervise_engine, opener, opts.restart_on_engine_death, life, done
        )
        try:
            async with trio.open_nursery() as nursery:
                names = opts.served_model_names or [engine.model_config.served_model_name]
                state = ServerState(
                    engine=engine,
                    served_model_names=names,
                    metrics=ServerMetrics(engine, names[0], opts.metrics_prefix),
                    nursery=nursery,
                    trust_request_chat_template=opts.trust_request_chat_template,
                    max_logprobs=opts.max_logprobs,
                    enable_auto_tool_choice=opts.enable_auto_tool_choice,
                    tool_call_parser=opts.tool_call_parser,
                    exclude_tools_when_tool_choice_none=opts.exclude_tools_when_tool_choice_none,
                    reasoning_parser=opts.reasoning_parser,
                    max_admitted=_max_admitted(engine, opts),
                    max_admitted_tokens=opts.max_num_admitted_tokens,
                )
                max_prompt_chars(state)  # the tokenizer's bound, once, before any request
                state.loras = await serving_lora.open_registry(engine, names[0], opts)
                log_len = opts.max_log_len if opts.enable_log_requests else None
                app = vllm_flags.wrap_asgi(build_app(state, opts.api_key, log_len), opts,
                                           state.metrics)  # fmt: skip
                shutdown = trio.Event()
                config = hypercorn_config(opts, listener)
                serve = partial(hypercorn_serve, app, config, shutdown_trigger=shutdown.wait)
                if opts.log_stats:  # ends with the serving (shutdown), never held up by it
                    nursery.start_soon(log_stats_periodically, engine, state.metrics,
                                       opts.log_stats_interval, shutdown)  # fmt: skip
                binds = await nursery.start(serve)
                life.serving = True
                logger.info("trillm is serving %s on %s", names[0], ", ".join(binds))
                await life.stop.wait()
                await _drain(state, opts.shutdown_timeout)
                shutdown.set()
                # Hypercorn closes its connections within its graceful timeout; the producers
                # end with their aborted requests. Anything left is cancelled, never waited on.
                nursery.cancel_scope.deadline = trio.current_time() + SHUTDOWN_BACKSTOP_S
            if nursery.cancel_scope.cancelled_caught:
                logger.warning("Shutdown cancelled what was still running after %.0f s.",
                               SHUTDOWN_BACKSTOP_S)  # fmt: skip
            logger.info("HTTP server stopped; shutting the engine down.")
        finally:
            done.set()
    logger.info("trillm stopped.")


def _max_admitted(engine: Any, opts: ServerOptions) -> int | None:
    """--max-num-queued-requests counts requests beyond what one batch runs (--max-num-seqs)."""
    if opts.max_num_queued_requests is None:
        return None
    return engine.config.scheduler.max_num_seqs + opts.max_num_queued_requests


async def _drain(state: ServerState, grace_s: float) -> None:
    """Refuse new requests, let running ones finish for ``grace_s``, then abort the rest."""
    state.draining = True
    logger.info("Draining %d running request(s) for up to %.0f s.", len(state.inflight), grace_s)
    if state.inflight:
        with trio.move_on_after(grace_s):
            await state.drained.wait()
    for request_id in list(state.inflight):
        await state.engine.abort(request_id)  # readers get finish_reason "abort"
