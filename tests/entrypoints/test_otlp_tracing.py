"""--otlp-traces-endpoint as vLLM's: a real ``trillm serve`` (fake runner) sends one
``llm_request`` span (kind SERVER) per engine request to in-process OTLP receivers (HTTP and
gRPC), with vLLM's gen_ai.* attributes, the incoming traceparent as parent, and the figures
/metrics observes; a dead collector harms nothing; --collect-detailed-traces needs the endpoint
(its times: test_detailed_traces.py)."""

from __future__ import annotations

import json
import sys

import httpx
import openai
import pytest
from otlp_receivers import SPAN_KIND_SERVER, BlackHole, GrpcReceiver, HttpReceiver
from server_harness import ServerProcess, metric_value

from trillm.entrypoints.openai.metrics import tracing

FAKE = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]
NAME = "traced-model"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
STREAM_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
STREAM_PARENT_ID = "b7ad6b7169203331"
MESSAGES = [{"role": "user", "content": "hello there"}]


def traceparent(trace_id: str, span_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{span_id}-01"}


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http_run(tmp_path_factory):
    """Over OTLP/HTTP: a chat (traceparent), a streamed chat (another traceparent), a
    completion with n=2 (none); /metrics once they ended; then the server stops, which sends
    the last spans."""
    receiver = HttpReceiver()
    log = tmp_path_factory.mktemp("otlp-http") / "server.log"
    args = [*FAKE, "--served-model-name", NAME, "--otlp-traces-endpoint", receiver.url]
    srv = ServerProcess(args, log).start()
    try:
        c = client(srv)
        chat = c.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=5,
            temperature=0.5,
            top_p=0.9,
            extra_headers=traceparent(TRACE_ID, PARENT_ID),
        )
        stream = c.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=traceparent(STREAM_TRACE_ID, STREAM_PARENT_ID),
        )
        chunks = list(stream)
        completion = c.completions.create(model=NAME, prompt="once upon", max_tokens=4, n=2)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        code = srv.stop()
        receiver.close()
    assert code == 0, srv.log()
    return receiver, chat, chunks, completion, metrics


def by_request(spans, request_id: str):
    return [s for s in spans if s.attributes["gen_ai.request.id"] == request_id]


def test_one_server_span_per_engine_request(http_run):
    receiver, chat, chunks, completion, _ = http_run
    spans = receiver.spans
    assert len(spans) == 4  # the chat, the stream, the completion's two samples
    assert set(receiver.paths) == {"/v1/traces"}
    for span in spans:
        assert span.name == "llm_request"
        assert span.kind == SPAN_KIND_SERVER
        assert span.resource["service.name"] == "trillm"
        assert span.attributes["gen_ai.response.model"] == NAME
    assert len(by_request(spans, chat.id)) == 1
    assert len(by_request(spans, chunks[0].id)) == 1
    for index in (0, 1):  # vLLM's child request ids for n > 1
        assert len(by_request(spans, f"{index}_{completion.id}")) == 1


def test_traceparent_makes_the_span_its_child(http_run):
    receiver, chat, chunks, completion, _ = http_run
    (span,) = by_request(receiver.spans, chat.id)
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    (streamed,) = by_request(receiver.spans, chunks[0].id)
    assert (streamed.trace_id, streamed.parent_span_id) == (STREAM_TRACE_ID, STREAM_PARENT_ID)
    roots = by_request(receiver.spans, f"0_{completion.id}")
    roots += by_request(receiver.spans, f"1_{completion.id}")
    assert all(s.parent_span_id == "" for s in roots)
    assert len({s.trace_id for s in roots} | {TRACE_ID, STREAM_TRACE_ID}) == 4


def test_request_and_usage_attributes(http_run):
    receiver, chat, chunks, completion, _ = http_run
    (span,) = by_request(receiver.spans, chat.id)
    a = span.attributes
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.n"] == 1
    assert a["gen_ai.usage.prompt_tokens"] == chat.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == chat.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == json.dumps([chat.choices[0].finish_reason])
    (streamed,) = by_request(receiver.spans, chunks[0].id)
    usage = chunks[-1].usage
    assert streamed.attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert streamed.attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens == 7
    samples = by_request(receiver.spans, f"0_{completion.id}")
    samples += by_request(receiver.spans, f"1_{completion.id}")
    assert sum(s.attributes["gen_ai.usage.completion_tokens"] for s in samples) == (
        completion.usage.completion_tokens
    )
    assert all(s.attributes["gen_ai.request.n"] == 2 for s in samples)
    reasons = sorted(s.attributes["gen_ai.response.finish_reasons"] for s in samples)
    assert reasons == sorted(json.dumps([c.finish_reason]) for c in completion.choices)


@pytest.mark.parametrize(
    ("attribute", "histogram"),
    [
        ("gen_ai.latency.e2e", "vllm:e2e_request_latency_seconds"),
        ("gen_ai.latency.time_to_first_token", "vllm:time_to_first_token_seconds"),
        ("gen_ai.latency.time_in_queue", "vllm:request_queue_time_seconds"),
        ("gen_ai.latency.time_in_model_prefill", "vllm:request_prefill_time_seconds"),
        ("gen_ai.latency.time_in_model_decode", "vllm:request_decode_time_seconds"),
        ("gen_ai.latency.time_in_model_inference", "vllm:request_inference_time_seconds"),
        ("gen_ai.usage.prompt_tokens", "vllm:request_prompt_tokens"),
        ("gen_ai.usage.completion_tokens", "vllm:request_generation_tokens"),
    ],
)
def test_span_figures_are_what_metrics_observed(http_run, attribute, histogram):
    receiver, *_, metrics = http_run
    values = [s.attributes[attribute] for s in receiver.spans]
    assert len(values) == metric_value(metrics, histogram + "_count")
    assert sum(values) == pytest.approx(metric_value(metrics, histogram + "_sum"), rel=1e-9)


def test_span_lasts_its_e2e_latency(http_run):
    receiver, *_ = http_run
    for span in receiver.spans:
        a = span.attributes
        assert span.end_ns - span.start_ns == round(a["gen_ai.latency.e2e"] * 1e9)
        assert 0 <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert (
            a["gen_ai.latency.time_in_model_prefill"] <= a["gen_ai.latency.time_in_model_inference"]
        )


def test_grpc_receiver_gets_the_spans(tmp_path_factory):
    """host:port (gRPC, vLLM's default protocol), a streamed chat with a traceparent."""
    receiver = GrpcReceiver()
    log = tmp_path_factory.mktemp("otlp-grpc") / "server.log"
    endpoint = f"127.0.0.1:{receiver.port}"
    srv = ServerProcess([*FAKE, "--otlp-traces-endpoint", endpoint], log).start()
    try:
        stream = client(srv).chat.completions.create(
            model=srv_model(srv),
            messages=MESSAGES,
            max_tokens=3,
            stream=True,
            extra_headers=traceparent(TRACE_ID, PARENT_ID),
        )
        chunks = list(stream)
    finally:
        code = srv.stop()
        receiver.close()
    assert code == 0, srv.log()
    (span,) = receiver.spans
    assert span.name == "llm_request" and span.kind == SPAN_KIND_SERVER
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert span.attributes["gen_ai.request.id"] == chunks[0].id
    assert span.attributes["gen_ai.usage.completion_tokens"] == 3


def srv_model(srv: ServerProcess) -> str:
    return client(srv).models.list().data[0].id


def test_a_dead_collector_does_not_harm_serving(tmp_path_factory):
    """A collector that accepts connections and never answers: requests are served, the
    server stops with exit 0 (the last export is abandoned after a bound)."""
    hole = BlackHole()
    log = tmp_path_factory.mktemp("otlp-dead") / "server.log"
    endpoint = f"grpc://127.0.0.1:{hole.port}"
    srv = ServerProcess([*FAKE, "--otlp-traces-endpoint", endpoint], log).start()
    try:
        c = client(srv)
        model = srv_model(srv)
        for _ in range(3):
            chat = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
            assert chat.usage.completion_tokens == 4
    finally:
        code = srv.stop()
        hole.close()
    assert code == 0, srv.log()


FORWARD = "gen_ai.latency.time_in_model_forward"
EXECUTE = "gen_ai.latency.time_in_model_execute"


def test_without_detailed_traces_no_model_times(http_run):
    """--collect-detailed-traces adds them (test_detailed_traces.py); without it, none."""
    receiver, *_ = http_run
    for span in receiver.spans:
        assert FORWARD not in span.attributes and EXECUTE not in span.attributes


def test_detailed_traces_need_an_endpoint_as_in_vllm(capsys):
    with pytest.raises(SystemExit):
        prepare_serve(["--collect-detailed-traces", "model"])
    err = capsys.readouterr().err
    assert "argument --collect-detailed-traces: requires --otlp-traces-endpoint to be set." in err


def prepare_serve(flags: list[str]) -> None:
    """``trillm serve``'s parsing and its tracing flags' check, in this process."""
    from trillm.entrypoints.cli.main import build_parser
    from trillm.entrypoints.cli.trace_flags import check_trace_flags

    args = build_parser().parse_args(["serve", *FAKE, *flags])
    check_trace_flags(args.serve_parser, args)


def test_protocol_follows_vllm_rule(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert tracing.exporter_protocol("localhost:4317") == "grpc"
    assert tracing.exporter_protocol("grpc://collector:4317") == "grpc"
    assert tracing.exporter_protocol("http://collector:4317") == "grpc"
    assert tracing.exporter_protocol("https://collector:4318/v1/traces") == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert tracing.exporter_protocol("http://collector:4318/custom") == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"):
        tracing.check_tracing("localhost:4317")


def test_without_the_packages_the_flag_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # an ImportError
    with pytest.raises(ValueError, match=r"--otlp-traces-endpoint needs .*trillm\[otel\]"):
        tracing.check_tracing("localhost:4317")
