"""The OpenAI-compatible HTTP server's process: the root nursery around the app (``http/app.py``).

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

import logging
import signal
import socket
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trillm import envs
from trillm.engine.stream_pacing import DEFAULT_WAKE_BUDGET
from trillm.entrypoints.openai.endpoints import lora
from trillm.entrypoints.openai.endpoints.base import ServerState, max_prompt_chars
from trillm.entrypoints.openai.endpoints.budgets import (
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    default_max_logprob_entries,
)
from trillm.entrypoints.openai.endpoints.responses_store import ResponseStore
from trillm.entrypoints.openai.engine_supervisor import supervise_engine
from trillm.entrypoints.openai.http.app import build_app
from trillm.entrypoints.openai.http.auth import ApiKeys
from trillm.entrypoints.openai.http.deployment import wrap_asgi
from trillm.entrypoints.openai.http.health_defaults import DEFAULT_HEALTH_STEP_TIMEOUT_S
from trillm.entrypoints.openai.http.listener import (
    hypercorn_config,
    hypercorn_serve,
    reserve_listener,
)
from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics
from trillm.entrypoints.openai.metrics.stats_logger import log_stats_periodically
from trillm.entrypoints.openai.metrics.tracing import RequestTracing
from trillm.gc_heap import freeze_startup_heap

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine
    from trillm.entrypoints.cli.lora_flags import LoRAModulePath

logger = logging.getLogger("trillm.server")

# After --shutdown-timeout and the aborts, what still runs (a producer nobody reads) gets
# this long before it is cancelled: shutdown never hangs.
SHUTDOWN_BACKSTOP_S = 10.0


@attrs.define
class ServerOptions:
    """What ``trillm serve`` needs beyond EngineArgs."""

    host: str = "0.0.0.0"
    port: int = 8000
    uds: str | None = None  # --uds: a Unix domain socket instead of host:port
    # --api-key (several keys: any one opens the gate); None: VLLM_API_KEY, as in vLLM.
    api_key: list[str] | None = None
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
    # Tool calling and reasoning (cli/serve_args._add_tool_flags).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None
    # What answers carry (cli/answer_flags.py): usage.prompt_tokens_details; usage on streams.
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False  # the default of the request field
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info
    # Requests waiting beyond the running batch (--max-num-seqs); past it, 503 at once.
    max_num_queued_requests: int | None = None
    # Tokens admitted at once (prompt + max_tokens per sequence); past it, 503 at once.
    max_num_admitted_tokens: int | None = None
    # Per-request budgets (request_budgets.py); None: the default from the model's length.
    max_logprob_entries: int | None = None
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    # On the engine's death: a new engine in the same process (else exit code 1).
    restart_on_engine_death: bool = False
    # /health's bound on one engine step in seconds (--health-step-timeout; None: none).
    health_step_timeout: float | None = DEFAULT_HEALTH_STEP_TIMEOUT_S
    # vLLM's deployment flags (cli/vllm_flags.py, http/deployment.py): TLS, CORS, proxy, logs,
    # metrics.
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
    # LoRA adapters served by name (--lora-modules: lora_flags.LoRAModulePath), and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter exist.
    lora_modules: list[LoRAModulePath] = attrs.field(factory=list)
    allow_runtime_lora_updating: bool = False
    lora_allowed_root: str | None = None  # runtime loads only from inside it (a real path)
    # --otlp-traces-endpoint: one OpenTelemetry span per request (metrics/tracing.py).
    otlp_traces_endpoint: str | None = None
    # --collect-detailed-traces: the model times the engine measures for the spans
    collect_detailed_traces: list[str] = attrs.field(factory=list)


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
    listener = reserve_listener(opts.host, opts.port, opts.uds)
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
    from trillm.config.batch_defaults import UsageContext
    from trillm.engine.engine_startup import open_engine

    # NOTE: the engine's preprocessor owns the chat template (stage 2), for HTTP and Python.
    opener = partial(
        open_engine,
        model,
        stream_wake_budget=opts.stream_wake_budget,
        chat_template=opts.chat_template,
        collect_detailed_traces=opts.collect_detailed_traces,
        usage_context=UsageContext.OPENAI_API_SERVER,
        **engine_args,
    )
    done = trio.Event()  # the HTTP server has stopped: the engine may go
    async with trio.open_nursery() as engines:
        slot = await engines.start(
            supervise_engine, opener, opts.restart_on_engine_death, life, done
        )
        engine = slot.as_engine()
        endpoint = opts.otlp_traces_endpoint
        tracing = None if endpoint is None else RequestTracing(endpoint)
        try:
            async with trio.open_nursery() as nursery:
                state = await open_server_state(engine, opts, nursery)
                state.tracing = tracing
                names = state.served_model_names
                log_len = opts.max_log_len if opts.enable_log_requests else None
                api_keys = ApiKeys.resolve(opts.api_key)
                logger.info("%s", api_keys.describe())
                app = build_app(state, api_keys, log_len, opts.health_step_timeout)
                app = wrap_asgi(app, opts, state.metrics)
                shutdown = trio.Event()
                config = hypercorn_config(opts, listener)
                serve = partial(hypercorn_serve, app, config, shutdown_trigger=shutdown.wait)
                if opts.log_stats:  # ends with the serving (shutdown), never held up by it
                    nursery.start_soon(
                        log_stats_periodically,
                        engine,
                        state.metrics,
                        opts.log_stats_interval,
                        shutdown,
                    )
                freeze_startup_heap("API server")  # the engine and app are built
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
                logger.warning(
                    "Shutdown cancelled what was still running after %.0f s.", SHUTDOWN_BACKSTOP_S
                )
            logger.info("HTTP server stopped; shutting the engine down.")
        finally:
            done.set()
    if tracing is not None:
        await tracing.close()  # the last spans out, within a bound
    logger.info("trillm stopped.")


async def open_server_state(
    engine: AsyncEngine, opts: ServerOptions, nursery: trio.Nursery
) -> ServerState:
    """What every route reads (``ServerState``) for ``engine`` under ``opts``; the requests'
    producers run in ``nursery``. ``trillm serve`` and ``trillm run-batch`` share it."""
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
        enable_prompt_tokens_details=opts.enable_prompt_tokens_details,
        enable_force_include_usage=opts.enable_force_include_usage,
        return_tokens_as_token_ids=opts.return_tokens_as_token_ids,
        enable_tokenizer_info_endpoint=opts.enable_tokenizer_info_endpoint,
        max_admitted=_max_admitted(engine, opts),
        max_admitted_tokens=opts.max_num_admitted_tokens,
        max_logprob_entries=opts.max_logprob_entries
        or default_max_logprob_entries(engine.model_config.max_model_len, opts.max_logprobs),
        max_sequences_per_request=opts.max_sequences_per_request,
        max_engine_seqs_per_request=_fair_share(engine),
        responses_store=ResponseStore() if envs.ENABLE_RESPONSES_API_STORE.get() else None,
    )
    max_prompt_chars(state)  # the tokenizer's bound, once, before any request
    state.loras = await lora.open_registry(
        engine,
        names[0],
        opts.lora_modules,
        opts.allow_runtime_lora_updating,
        opts.lora_allowed_root,
    )
    return state


def _max_admitted(engine: AsyncEngine, opts: ServerOptions) -> int | None:
    """--max-num-queued-requests counts requests beyond what one batch runs (--max-num-seqs)."""
    if opts.max_num_queued_requests is None:
        return None
    return engine.config.scheduler.max_num_seqs + opts.max_num_queued_requests


def _fair_share(engine: AsyncEngine) -> int:
    """Fair admission: 3/4 of what the engine runs at once (--max-num-seqs on each
    data-parallel core) for one request's sequences, so a request sent later starts at once
    beside the largest one, which alone still keeps most of the batch."""
    config = engine.config
    return max(1, config.scheduler.max_num_seqs * config.parallel.data_parallel_size * 3 // 4)


async def _drain(state: ServerState, grace_s: float) -> None:
    """Refuse new requests, let running ones finish for ``grace_s``, then abort the rest."""
    state.draining = True
    logger.info("Draining %d running request(s) for up to %.0f s.", len(state.inflight), grace_s)
    if state.inflight:
        with trio.move_on_after(grace_s):
            await state.drained.wait()
    for request_id in list(state.inflight):
        await state.engine.abort(request_id)  # readers get finish_reason "abort"
