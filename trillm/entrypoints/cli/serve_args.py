"""``trillm serve``'s flags (vLLM's names) and their mapping onto EngineArgs fields."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from trillm import envs
from trillm.config import EngineArgs
from trillm.engine.stream_pacing import DEFAULT_WAKE_BUDGET
from trillm.entrypoints.cli import (
    answer_flags,
    config_file,
    engine_flags,
    flag_types,
    headless,
    lora_flags,
    trace_flags,
    vllm_flags,
)
from trillm.entrypoints.openai.http.health_defaults import DEFAULT_HEALTH_STEP_TIMEOUT_S

if TYPE_CHECKING:  # the server's modules (trio, quart) load only when it runs, not for --help
    from trillm.entrypoints.openai.api_server import ServerOptions


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="Run the OpenAI-compatible HTTP server.",
        description="Serve MODEL (a local Hugging Face folder or a hub id) over an "
        "OpenAI-compatible HTTP API. Without MODEL, the embedded default model is served.",
    )
    add_serve_flags(p)
    p.set_defaults(func=run_serve, serve_parser=p)
    return p


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """MODEL and every flag of ``trillm serve`` (``trillm run-batch`` takes them too)."""
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="Model folder or hub id.")
    p.add_argument("--model", dest="model_opt", help="Same as the positional MODEL.")
    _add_server_flags(p)
    engine_flags.add_engine_flags(p)  # one per EngineArgs field
    headless.add_node_flags(p)
    _add_tool_flags(p)
    lora_flags.add_lora_flags(p)
    # vLLM's deployment flags: TLS, CORS, proxy, logging, metrics, --config.
    vllm_flags.add_http_flags(p)
    vllm_flags.add_logging_flags(p)
    vllm_flags.add_engine_compat_flags(p)
    trace_flags.add_trace_flags(p)
    answer_flags.add_answer_flags(p)
    config_file.add_config_flag(p)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="Address to listen on (default: 0.0.0.0).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    g.add_argument(
        "--api-key",
        nargs="+",
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' (any "
        "one of the keys given) on every route but /health, /ping, /version and /metrics. "
        "Default: the VLLM_API_KEY environment variable; this flag wins over it.",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept a 'chat_template' sent in a request (refused with 400 otherwise).",
    )
    g.add_argument(
        "--uvicorn-log-level",
        "--log-level",
        dest="log_level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level (default: info; debug/trace also log every request).",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="On SIGINT/SIGTERM, seconds to let running requests finish before aborting "
        "them (default: 30).",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=flag_types.positive_seconds,
        default=5.0,
        help="Seconds an idle HTTP keep-alive connection stays open (default: 5, as uvicorn "
        "and vLLM, which sets it with VLLM_HTTP_TIMEOUT_KEEP_ALIVE).",
    )
    g.add_argument(
        "--max-num-queued-requests",
        type=flag_types.non_negative_int,
        help="Most requests waiting beyond the running batch (--max-num-seqs, counting each "
        "prompt and sample); past it a request gets 503 with Retry-After at once, before any "
        "work. Default: no bound.",
    )
    g.add_argument(
        "--max-num-admitted-tokens",
        type=flag_types.positive_int,
        help="Most tokens admitted at once, running or waiting: each sequence (prompt and "
        "sample) counts its prompt tokens plus its max_tokens. A request that would pass it "
        "gets 503 with Retry-After at once, whole (all its prompts and samples, or none); one "
        "larger than N by itself, a 400. Default: no bound. (Not vLLM's --max-num-queued-tokens, "
        "which sums the prompt tokens of requests still in prefill.)",
    )
    g.add_argument(
        "--max-logprob-entries",
        type=flag_types.positive_int,
        help="Most logprob entries one request may ask for, over all its prompts and samples: "
        "each prompt token counts prompt_logprobs + 1, each sampled token logprobs + 1 "
        "(max_tokens x n). More is a 400 before the request reaches the engine. Default: "
        "2**20, or max_model_len x (max_logprobs + 1) if larger.",
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=flag_types.positive_int,
        default=1024,
        help="Most sequences (prompts x n) in one request; more is a 400 (default: 1024). "
        "(vLLM's VLLM_MAX_N_SEQUENCES bounds n alone.)",
    )
    g.add_argument(
        "--health-step-timeout",
        type=flag_types.health_step_timeout,
        default=DEFAULT_HEALTH_STEP_TIMEOUT_S,
        metavar="SECONDS",
        help="/health answers 503 while an engine step has run longer than "
        "this (a worker stopped or hung; the executor ends such a step after 300 s). 0: never. "
        f"Default: {DEFAULT_HEALTH_STEP_TIMEOUT_S:g}.",
    )
    g.add_argument(
        "--restart-on-engine-death",
        action="store_true",
        help="When the engine dies (a worker killed), start a new one in this process instead "
        "of exiting with code 1 after 2 s (the default).",
    )
    g.add_argument(
        "--stream-wake-budget",
        type=int,
        default=DEFAULT_WAKE_BUDGET,
        help="Streams woken per engine step for a middle chunk: at least N, more when the "
        "model's step time hides their writes. With more streams, each gets a chunk every "
        "ceil(streams / budget) steps carrying those steps' tokens; the first token and the "
        f"end still go at once. 0: no budget (default: {DEFAULT_WAKE_BUDGET}).",
    )


def _add_tool_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tool calling and reasoning")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Parse tool calls from the output when tool_choice is 'auto' (the default when a "
        "request has tools); needs --tool-call-parser.",
    )
    g.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="The model family's tool-call format (vLLM's names): hermes (Qwen2.5/Qwen3), "
        "qwen3_coder / qwen3_xml (Qwen3-Coder), glm45, kimi_k2, deepseek_v3, deepseek_v31, "
        "minimax_m2, granite, internlm, jamba, phi4_mini_json, llama3_json, llama4_json, "
        "llama4_pythonic, mistral, pythonic, openai (gpt-oss), or one a --tool-parser-plugin "
        "registers.",
    )
    g.add_argument(
        "--tool-parser-plugin",
        metavar="PATH",
        help="A Python file that registers tool parsers (trillm.parsers.tool_parsers."
        "register_tool_parser).",
    )
    g.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="With tool_choice 'none', do not render the tools into the prompt.",
    )


def check_tool_flags(args: argparse.Namespace) -> None:
    """Load --tool-parser-plugin and check the parser names (exit 2, as argparse, if bad)."""
    from trillm.parsers.reasoning import get_reasoning_parser
    from trillm.parsers.tool_parsers import get_tool_parser, load_tool_parser_plugin

    try:
        if args.tool_parser_plugin:
            load_tool_parser_plugin(args.tool_parser_plugin)
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME.")
        if args.tool_call_parser:
            get_tool_parser(args.tool_call_parser)
        if args.reasoning_parser:
            get_reasoning_parser(args.reasoning_parser)
    except ValueError as exc:
        print(f"trillm serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs fields from the parsed flags (only those given)."""
    kwargs = engine_flags.engine_kwargs(args)
    kwargs.pop("chat_template", None)  # the server hands it over (ServerOptions.chat_template)
    return kwargs


def server_options(args: argparse.Namespace) -> ServerOptions:
    from trillm.entrypoints.openai.api_server import ServerOptions

    check_tool_flags(args)
    return ServerOptions(
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        root_path=args.root_path,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        log_stats=not args.disable_log_stats,
        log_stats_interval=args.log_stats_interval,
        metrics_prefix=args.metrics_prefix,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        reasoning_parser=args.reasoning_parser,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        host=args.host,
        port=args.port,
        uds=args.uds,
        api_key=args.api_key,
        served_model_names=args.served_model_name,
        chat_template=args.chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        max_logprobs=EngineArgs.max_logprobs if args.max_logprobs is None else args.max_logprobs,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        keep_alive_timeout=args.timeout_keep_alive,
        stream_wake_budget=args.stream_wake_budget or None,
        max_num_queued_requests=args.max_num_queued_requests,
        max_num_admitted_tokens=args.max_num_admitted_tokens,
        max_logprob_entries=args.max_logprob_entries,
        max_sequences_per_request=args.max_sequences_per_request,
        restart_on_engine_death=args.restart_on_engine_death,
        health_step_timeout=args.health_step_timeout,
        lora_modules=args.lora_modules or [],
        allow_runtime_lora_updating=lora_flags.runtime_updating_allowed(
            args.allow_runtime_lora_updating
        ),
        lora_allowed_root=args.lora_allowed_root,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        collect_detailed_traces=trace_flags.detailed_traces(args),
    )


def run_serve(args: argparse.Namespace) -> int:
    import logging

    import trio

    from trillm.entrypoints.openai.api_server import run_server
    from trillm.entrypoints.openai.http.listener import PortUnavailableError

    model = prepare(args)
    if args.headless:
        from trillm.entrypoints.cli.headless import run_headless

        try:
            return run_headless(model, engine_kwargs(args))
        except ValueError as exc:  # a flag the engine refuses: exit 2, as for node 0
            args.serve_parser.error(str(exc))
    try:
        return trio.run(run_server, model, engine_kwargs(args), server_options(args))
    except PortUnavailableError as exc:  # the address, bound first: reported before any load
        logging.getLogger("trillm.server").error("%s", exc)
        return 1


def prepare(args: argparse.Namespace) -> str | None:
    """Check the flags together (exit 2 naming one that is wrong), set up logging and the
    download folder; -> the model (None: the embedded default)."""
    import logging

    from trillm.logging_config import LoggingConfigError, configure_logging

    vllm_flags.check_flags(args.serve_parser, args)
    trace_flags.check_trace_flags(args.serve_parser, args)
    headless.check_node_flags(args.serve_parser, args)
    lora_flags.check_lora_flags(args.serve_parser, args)
    try:
        envs.check_all()
    except ValueError as exc:  # an environment variable set to what it does not take
        args.serve_parser.error(str(exc))
    try:
        configure_logging(args.log_level, args.log_format)
    except (LoggingConfigError, ValueError, TypeError, AttributeError, ImportError) as exc:
        # dictConfig's own errors are ValueError & co.; the file is the user's: exit 2.
        args.serve_parser.error(f"logging configuration: {exc}")
    for note in vllm_flags.startup_notes(args):
        logging.getLogger("trillm.server").info(note)
    vllm_flags.apply_download_dir(args.download_dir)
    if args.disable_uvicorn_access_log:
        logging.getLogger("hypercorn.access").disabled = True
    model: str | None = args.model_opt or args.model_tag or args.config_model  # --config's last
    return model
