"""OpenTelemetry request spans, as vLLM makes them (``--otlp-traces-endpoint``).

Each engine request (a prompt's sample) that finishes becomes one span named ``llm_request``,
kind SERVER, with vLLM's ``gen_ai.*`` attribute names (vllm/tracing.py ``SpanAttributes``),
the child of the W3C ``traceparent`` its HTTP request came with. Its figures are the ones
/metrics observes for it (``SampleTimes``, handed over by ``RequestTimer``), so a trace and
the histograms never disagree; the span lasts exactly its ``gen_ai.latency.e2e``.

Spans leave through the SDK's BatchSpanProcessor, whose own thread talks to the collector:
ending a span only appends it to a bounded queue, so a slow or dead collector costs a request
nothing (the queue drops spans when full). The packages are the optional ``otel`` extra,
imported only when tracing is on.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import trio

from trillm import envs

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

    from trillm.entrypoints.openai.metrics.sample_times import SampleTimes
    from trillm.outputs import RequestOutput
    from trillm.sampling_params import SamplingParams

logger = logging.getLogger("trillm.server")

INSTALL = "pip install 'trillm[otel]'"
PROTOCOLS = ("grpc", "http/protobuf")
SERVICE_NAME = "trillm"  # service.name unless OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES say
SPAN_NAME = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")
CLOSE_S = 5.0  # the most a shutdown waits for the last spans to leave


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py), exactly."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # --collect-detailed-traces model / worker (config/observability.py)
    TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


def check_tracing(endpoint: str) -> None:
    """A ValueError naming what stops ``--otlp-traces-endpoint`` (the packages, the protocol),
    raised at start-up rather than at the first request."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporters ({INSTALL}): "
            f"{exc}"
        ) from None
    exporter_protocol(endpoint)


def exporter_protocol(endpoint: str) -> str:
    """vLLM's rule: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc when unset. Unset, a full OTLP/HTTP
    URL (its path ending in /v1/traces) is taken as http/protobuf: gRPC would drop the path and
    never reach that receiver."""
    chosen = envs.OTLP_TRACES_PROTOCOL.get()
    if chosen is None:
        path = urlparse(endpoint).path.rstrip("/")
        return "http/protobuf" if path.endswith("/v1/traces") else "grpc"
    if chosen not in PROTOCOLS:
        raise ValueError(
            f"{envs.OTLP_TRACES_PROTOCOL.name}={chosen!r}: expected one of {', '.join(PROTOCOLS)}."
        )
    return chosen


def _exporter(endpoint: str) -> SpanExporter:
    if exporter_protocol(endpoint) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # As vLLM: plaintext unless the endpoint is https:// (host:port, grpc://, http://).
        return OTLPSpanExporter(endpoint=endpoint, insecure=urlparse(endpoint).scheme != "https")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter(endpoint=endpoint)


def _provider(endpoint: str) -> TracerProvider:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    # NOTE: closed by RequestTracing.close (bounded), not at interpreter exit (unbounded).
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    return provider


class RequestTracing:
    """The server's tracer (``ServerState.tracing``); ``request`` starts one HTTP request's."""

    def __init__(self, endpoint: str) -> None:
        self.provider = _provider(endpoint)
        self.tracer = self.provider.get_tracer("trillm.entrypoints.openai")
        logger.info(
            "OpenTelemetry: request spans to %s (%s).", endpoint, exporter_protocol(endpoint)
        )

    def request(self, params: SamplingParams | None, model: str) -> RequestTrace:
        """The trace of the HTTP request being handled: its parent from the request's
        ``traceparent`` / ``tracestate`` headers (none outside a request, e.g. a batch file);
        ``params`` None: a pooling request's (no sampling attributes, as vLLM's)."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from quart import has_request_context, request

        carrier: dict[str, str] = {}
        if has_request_context():
            carrier = {h: v for h in TRACE_HEADERS if (v := request.headers.get(h)) is not None}
        parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
        return RequestTrace(self.tracer, parent, _request_attributes(params, model))

    async def close(self) -> None:
        """Send what is queued, for at most ``CLOSE_S`` (a dead collector does not hold the
        exit up; what is left is dropped)."""
        with trio.move_on_after(CLOSE_S):
            await trio.to_thread.run_sync(self.provider.shutdown, abandon_on_cancel=True)


def _request_attributes(params: SamplingParams | None, model: str) -> dict[str, Any]:
    """The request's own attributes; as vLLM, a parameter that is 0 / unset is left out."""
    attrs: dict[str, Any] = {SpanAttributes.RESPONSE_MODEL: model}
    if params is None:
        return attrs
    for name, value in (
        (SpanAttributes.REQUEST_TOP_P, params.top_p),
        (SpanAttributes.REQUEST_MAX_TOKENS, params.max_tokens),
        (SpanAttributes.REQUEST_TEMPERATURE, params.temperature),
        (SpanAttributes.REQUEST_N, params.n),
    ):
        if value:
            attrs[name] = value
    return attrs


class RequestTrace:
    """One HTTP request's spans: ``sample_ended`` (``RequestTimer.on_end``) makes one per
    engine request as it finishes."""

    __slots__ = ("tracer", "parent", "attributes")

    def __init__(self, tracer: Tracer, parent: Context | None, attributes: dict[str, Any]) -> None:
        self.tracer = tracer
        self.parent = parent  # the remote caller's span, None: a root span
        self.attributes = attributes

    def sample_ended(self, t: SampleTimes, out: RequestOutput, index: int) -> None:
        from opentelemetry.trace import SpanKind

        end = time.time_ns()
        attributes = dict(self.attributes)
        attributes[SpanAttributes.REQUEST_ID] = _request_id(out, index, self.attributes)
        attributes[SpanAttributes.RESPONSE_FINISH_REASONS] = _finish_reasons(out, index)
        attributes.update(_figures(t))
        attributes.update(_model_times(out, index))
        span = self.tracer.start_span(
            SPAN_NAME,
            context=self.parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=end - round(t.e2e * 1e9),
        )
        span.end(end_time=end)


def _request_id(out: RequestOutput, index: int, attributes: dict[str, Any]) -> str:
    """The engine request's id; with n > 1 each sample's as vLLM names its child requests
    (``{index}_{parent id}``)."""
    if attributes.get(SpanAttributes.REQUEST_N, 1) > 1:
        return f"{index}_{out.request_id}"
    return str(out.request_id)


def _finish_reasons(out: RequestOutput, index: int) -> str:
    """vLLM's value: a JSON list of the engine request's one finish reason. A pooling
    request's output has no sample: vLLM's scheduler stops it once its output exists."""
    reasons = [str(c.finish_reason) for c in out.outputs if c.index == index and c.finish_reason]
    return json.dumps(reasons[:1] or ["stop"])


def _model_times(out: RequestOutput, index: int) -> dict[str, float]:
    """--collect-detailed-traces: the sample's model forward / execute seconds, those asked
    for (the engine measures only those); a pooling request's are on its metrics."""
    pairs = [(c.model_forward_time, c.model_execute_time) for c in out.outputs if c.index == index]
    if not pairs and out.metrics is not None:
        pairs = [(out.metrics.model_forward_time, out.metrics.model_execute_time)]
    times: dict[str, float] = {}
    for forward, execute in pairs[:1]:
        if forward is not None:
            times[SpanAttributes.TIME_IN_MODEL_FORWARD] = forward
        if execute is not None:
            times[SpanAttributes.TIME_IN_MODEL_EXECUTE] = execute
    return times


def _figures(t: SampleTimes) -> dict[str, Any]:
    figures = {
        SpanAttributes.USAGE_PROMPT_TOKENS: t.prompt_tokens,
        SpanAttributes.USAGE_COMPLETION_TOKENS: t.completion_tokens,
        SpanAttributes.E2E: t.e2e,
        SpanAttributes.TIME_TO_FIRST_TOKEN: t.ttft,
        SpanAttributes.TIME_IN_QUEUE: t.queue,
        SpanAttributes.TIME_IN_MODEL_PREFILL: t.prefill,
        SpanAttributes.TIME_IN_MODEL_DECODE: t.decode,
        SpanAttributes.TIME_IN_MODEL_INFERENCE: t.inference,
    }
    return {name: value for name, value in figures.items() if value is not None}
