"""vLLM's tracing flags on ``trillm serve``: ``--otlp-traces-endpoint`` (one OpenTelemetry span
per request, ``entrypoints/openai/metrics/tracing.py``) and ``--collect-detailed-traces``
(``config/observability.py``), which adds to each span the times vLLM's V0 engine added:
``model`` the request's model forward time (``gen_ai.latency.time_in_model_forward``),
``worker`` its time in the worker's execute call, P2 and P3 of trillm's steps
(``gen_ai.latency.time_in_model_execute``), each summed over the steps that ran it, ``all``
both. The ranks time each step only with the flag (``worker/step_timing.py``); the engine core
sums the times per request (``engine/core_traces.py``). As in vLLM, it needs
``--otlp-traces-endpoint``."""

from __future__ import annotations

import argparse

from trillm.config.observability import DETAILED_TRACE_MODULES, detailed_trace_modules


def _modules(value: str) -> list[str]:
    """One value of --collect-detailed-traces; vLLM also takes them comma-separated."""
    try:
        return detailed_trace_modules(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            str(exc).removeprefix("collect_detailed_traces: ")
        ) from None


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
        metavar="{" + ",".join(DETAILED_TRACE_MODULES) + "}",
        help="Add to each span the request's time in the model's forward "
        "(model: gen_ai.latency.time_in_model_forward) and/or in the worker's execute call "
        "(worker: gen_ai.latency.time_in_model_execute), in seconds summed over the steps "
        "that ran it; all: both (also comma-separated). Each step is timed. Needs "
        "--otlp-traces-endpoint.",
    )


def detailed_traces(args: argparse.Namespace) -> list[str]:
    """The modules --collect-detailed-traces named, in order, once each ([]: none)."""
    groups = args.collect_detailed_traces or []
    return detailed_trace_modules([m for group in groups for m in group])


def check_trace_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 naming what cannot be done: detailed traces without an endpoint (vLLM's rule),
    tracing without its packages or with a protocol the exporter does not speak."""
    from trillm.entrypoints.openai.metrics.tracing import check_tracing

    if args.collect_detailed_traces is not None and args.otlp_traces_endpoint is None:
        parser.error(
            "argument --collect-detailed-traces: requires --otlp-traces-endpoint to be set."
        )
    if args.otlp_traces_endpoint is not None:
        try:
            check_tracing(args.otlp_traces_endpoint)
        except ValueError as exc:
            parser.error(str(exc))
