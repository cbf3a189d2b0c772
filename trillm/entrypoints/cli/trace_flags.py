"""vLLM's tracing flags on ``trillm serve``: ``--otlp-traces-endpoint`` honoured (one OpenTelemetry
span per request, ``entrypoints/openai/metrics/tracing.py``); ``--collect-detailed-traces``
refused, naming the span attribute each value asks for. vLLM's V0 engine added them to its
span: ``model`` the request's model forward time, ``worker`` its time in the worker's execute
call, each summed over the steps that ran it, ``all`` both; trillm measures neither per
request, and vLLM's v1 engine accepts the flag and records neither either (accepting it here
would be a flag that does nothing)."""

from __future__ import annotations

import argparse

DETAILED_TRACE_MODULES = ("model", "worker", "all")
FORWARD = "gen_ai.latency.time_in_model_forward"
EXECUTE = "gen_ai.latency.time_in_model_execute"
# value -> the span attributes vLLM (V0) added for it
DETAILED_ATTRIBUTES = {"model": (FORWARD,), "worker": (EXECUTE,), "all": (FORWARD, EXECUTE)}


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
        help="Refused: the per-request model forward (model) / execute (worker) times these "
        "add to spans are not measured.",
    )


def check_trace_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 naming what cannot be done: detailed traces, tracing without its packages or
    with a protocol the exporter does not speak."""
    from trillm.entrypoints.openai.metrics.tracing import check_tracing

    if args.collect_detailed_traces is not None:
        parser.error(_detailed_traces_refusal(args))
    if args.otlp_traces_endpoint is not None:
        try:
            check_tracing(args.otlp_traces_endpoint)
        except ValueError as exc:
            parser.error(str(exc))


def _detailed_traces_refusal(args: argparse.Namespace) -> str:
    """Why ``--collect-detailed-traces`` stops the start: vLLM's own rule first (it needs an
    endpoint), then what its values ask for."""
    if args.otlp_traces_endpoint is None:
        return "argument --collect-detailed-traces: requires --otlp-traces-endpoint to be set."
    values = list(dict.fromkeys(m for group in args.collect_detailed_traces for m in group))
    asked = list(dict.fromkeys(a for m in values for a in DETAILED_ATTRIBUTES[m]))
    return (
        f"argument --collect-detailed-traces: {','.join(values)} asks each span for "
        f"{' and '.join(asked)} (the request's time in the model's forward / the worker's "
        "execute call, summed over its steps), which trillm does not measure; "
        "--otlp-traces-endpoint's spans carry the queue, prefill, decode and inference times."
    )
