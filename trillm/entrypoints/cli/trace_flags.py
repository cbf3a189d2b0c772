"""vLLM's tracing flags on ``trillm serve``: ``--otlp-traces-endpoint`` honoured (one OpenTelemetry
span per request, ``entrypoints/openai/metrics/tracing.py``); ``--collect-detailed-traces``
refused by name, since the per-request model forward / execute times it asks for are not
measured (vLLM's v1 engine accepts it and records none of them either)."""

from __future__ import annotations

import argparse

DETAILED_TRACE_MODULES = ("model", "worker", "all")


def _modules(value: str) -> list[str]:
    """One value of --collect-detailed-traces; vLLM also takes them comma-separated."""
    parts = [part.strip() for part in value.split(",")]
    for part in parts:
        if part not in DETAILED_TRACE_MODULES:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {part!r} (choose from {', '.join(DETAILED_TRACE_MODULES)})"
            )
    return parts


def add_trace_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tracing (vLLM's flags)")
    g.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="Send one OpenTelemetry span per request (llm_request, vLLM's gen_ai.* attributes) "
        "to this OTLP collector: gRPC for host:port or grpc://host:port, HTTP/protobuf for a "
        "full http(s)://.../v1/traces URL (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL overrides). "
        "Needs the otel extra: pip install 'trillm[otel]'.",
    )
    g.add_argument(
        "--collect-detailed-traces",
        nargs="+",
        type=_modules,
        metavar="{model,worker,all}",
        help="Refused: per-request model forward / execute times are not collected.",
    )


def check_trace_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 naming what cannot be done: detailed traces, tracing without its packages or
    with a protocol the exporter does not speak."""
    from trillm.entrypoints.openai.metrics.tracing import check_tracing

    if args.collect_detailed_traces is not None:
        parser.error(
            "argument --collect-detailed-traces: per-request model forward / execute times "
            "(gen_ai.latency.time_in_model_forward / _execute) are not collected yet; "
            "--otlp-traces-endpoint's spans carry the queue, prefill, decode and inference times."
        )
    if args.otlp_traces_endpoint is not None:
        try:
            check_tracing(args.otlp_traces_endpoint)
        except ValueError as exc:
            parser.error(str(exc))
