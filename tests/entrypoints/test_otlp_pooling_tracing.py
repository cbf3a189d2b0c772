"""--otlp-traces-endpoint on the pooling routes, as vLLM traces them: vLLM's embedding,
pooling, classify and score handlers pass the HTTP request's trace headers to ``encode`` for
each input, and its output processor makes one ``llm_request`` span (kind SERVER) for every
finished engine request, pooling or not. So each input of /v1/embeddings, /pooling, /classify
and /rerank is one span here, named by its engine request id, the child of the request's
traceparent, without sampling attributes, with no completion tokens; and its figures are what
/metrics observed for it (trillm recorded no pooling request on /metrics before)."""

from __future__ import annotations

import httpx
import pytest
from otlp_receivers import SPAN_KIND_SERVER, HttpReceiver
from server_harness import ServerProcess, metric_value

from trillm.testing.tiny_bert import build_tiny_encoder, write_pooling_files

TRACE_ID = "5cf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "01f067aa0ba902b7"
CLASSIFY_TRACE_ID = "6df92f3577b34da6a3ce929d0e0e4736"
CLASSIFY_PARENT_ID = "02f067aa0ba902b7"
INPUTS = ["a fox jumps over the dog", "paris"]
DOCS = ["Paris is the capital of France.", "The weather today is sunny.", "A fox jumps."]
SAMPLING = (
    "gen_ai.request.max_tokens",
    "gen_ai.request.temperature",
    "gen_ai.request.top_p",
    "gen_ai.request.n",
)
# span attribute -> the /metrics histogram that observed the same figure
HISTOGRAMS = {
    "gen_ai.latency.e2e": "vllm:e2e_request_latency_seconds",
    "gen_ai.latency.time_to_first_token": "vllm:time_to_first_token_seconds",
    "gen_ai.latency.time_in_queue": "vllm:request_queue_time_seconds",
    "gen_ai.latency.time_in_model_prefill": "vllm:request_prefill_time_seconds",
    "gen_ai.latency.time_in_model_decode": "vllm:request_decode_time_seconds",
    "gen_ai.latency.time_in_model_inference": "vllm:request_inference_time_seconds",
    "gen_ai.usage.prompt_tokens": "vllm:request_prompt_tokens",
    "gen_ai.usage.completion_tokens": "vllm:request_generation_tokens",
}
SPANS = {"embed_run": 3, "cross_encoder_run": 1 + len(DOCS)}  # one per input


def traceparent(trace_id: str, span_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{span_id}-01"}


def serve(model, receiver: HttpReceiver, log, *flags: str) -> ServerProcess:
    args = ["--model", str(model), "--disable-log-stats", *flags]
    return ServerProcess([*args, "--otlp-traces-endpoint", receiver.url], log).start()


def post(srv: ServerProcess, path: str, body: dict, headers: dict | None = None) -> dict:
    r = httpx.post(srv.url + path, json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def embed_run(tmp_path_factory):
    """A BERT embedder with --collect-detailed-traces all: /v1/embeddings of two inputs
    (traceparent), /pooling of one (none); /metrics once they ended; the server stopped, which
    sends the last spans."""
    path = build_tiny_encoder("BertModel", tmp_path_factory.mktemp("embed"))
    write_pooling_files(path, "mean", normalize=True)
    receiver = HttpReceiver()
    log = tmp_path_factory.mktemp("embed-serve") / "server.log"
    srv = serve(path, receiver, log, "--collect-detailed-traces", "all")
    try:
        headers = traceparent(TRACE_ID, PARENT_ID)
        embeddings = post(srv, "/v1/embeddings", {"input": INPUTS}, headers)
        pooling = post(srv, "/pooling", {"input": "a lone input"})
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        code = srv.stop()
        receiver.close()
    assert code == 0, srv.log()
    return receiver.spans, embeddings, pooling, metrics


@pytest.fixture(scope="module")
def cross_encoder_run(tmp_path_factory):
    """A BERT cross-encoder: /classify of one input (traceparent), /rerank of three documents."""
    path = build_tiny_encoder("BertForSequenceClassification", tmp_path_factory.mktemp("ce"))
    receiver = HttpReceiver()
    srv = serve(path, receiver, tmp_path_factory.mktemp("ce-serve") / "server.log")
    try:
        headers = traceparent(CLASSIFY_TRACE_ID, CLASSIFY_PARENT_ID)
        classified = post(srv, "/classify", {"input": "a fox"}, headers)
        post(srv, "/rerank", {"query": "capital of france", "documents": DOCS})
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        code = srv.stop()
        receiver.close()
    assert code == 0, srv.log()
    return receiver.spans, classified, metrics


def span_of(spans, request_id: str):
    (span,) = [s for s in spans if s.attributes["gen_ai.request.id"] == request_id]
    return span


def test_one_server_span_per_embedded_input(embed_run):
    spans, embeddings, pooling, _ = embed_run
    assert len(spans) == 3  # the two embedded inputs, the pooled one
    for span in spans:
        assert span.name == "llm_request"
        assert span.kind == SPAN_KIND_SERVER
        assert span.resource["service.name"] == "trillm"
        assert not set(SAMPLING) & span.attributes.keys()
        assert span.attributes["gen_ai.usage.completion_tokens"] == 0
        assert span.attributes["gen_ai.response.finish_reasons"] == '["stop"]'
        assert span.attributes["gen_ai.latency.time_in_model_decode"] == 0
        assert span.end_ns - span.start_ns == round(span.attributes["gen_ai.latency.e2e"] * 1e9)
    embedded = [span_of(spans, f"{embeddings['id']}-{i}") for i in range(len(INPUTS))]
    assert all((s.trace_id, s.parent_span_id) == (TRACE_ID, PARENT_ID) for s in embedded)
    prompt_tokens = sum(s.attributes["gen_ai.usage.prompt_tokens"] for s in embedded)
    assert prompt_tokens == embeddings["usage"]["prompt_tokens"]
    lone = span_of(spans, f"{pooling['id']}-0")
    assert lone.parent_span_id == "" and lone.trace_id != TRACE_ID


def test_classify_and_rerank_inputs_are_spans(cross_encoder_run):
    spans, classified, _ = cross_encoder_run
    assert len(spans) == 1 + len(DOCS)  # a rerank scores each (query, document) pair
    span = span_of(spans, f"{classified['id']}-0")
    assert (span.trace_id, span.parent_span_id) == (CLASSIFY_TRACE_ID, CLASSIFY_PARENT_ID)
    assert span.attributes["gen_ai.usage.prompt_tokens"] == classified["usage"]["prompt_tokens"]
    assert all(s.name == "llm_request" and s.kind == SPAN_KIND_SERVER for s in spans)


@pytest.mark.parametrize("run", ["embed_run", "cross_encoder_run"])
@pytest.mark.parametrize(("attribute", "histogram"), HISTOGRAMS.items())
def test_span_figures_are_what_metrics_observed(request, run, attribute, histogram):
    spans, *_, metrics = request.getfixturevalue(run)
    values = [s.attributes[attribute] for s in spans]
    assert len(values) == SPANS[run]
    assert len(values) == metric_value(metrics, histogram + "_count")
    assert sum(values) == pytest.approx(metric_value(metrics, histogram + "_sum"), rel=1e-9)


@pytest.mark.parametrize("run", ["embed_run", "cross_encoder_run"])
def test_pooling_requests_finish_as_stop_on_metrics(request, run):
    """vLLM's scheduler stops a pooling request once its output exists; no token generated."""
    spans, *_, metrics = request.getfixturevalue(run)
    assert len(spans) == SPANS[run]
    stopped = 'vllm:request_success_total{engine="0",finished_reason="stop"'
    line = next(line for line in metrics.splitlines() if line.startswith(stopped))
    assert float(line.rsplit(" ", 1)[1]) == len(spans)
    assert metric_value(metrics, "vllm:generation_tokens_total") == 0
    prompt_tokens = sum(s.attributes["gen_ai.usage.prompt_tokens"] for s in spans)
    assert metric_value(metrics, "vllm:prompt_tokens_total") == prompt_tokens


def test_detailed_traces_on_pooling_spans(embed_run, cross_encoder_run):
    """--collect-detailed-traces all (the embedder's server): each input's span carries its
    model forward and execute seconds; the cross-encoder's server, without the flag, none."""
    forward, execute = (
        "gen_ai.latency.time_in_model_forward",
        "gen_ai.latency.time_in_model_execute",
    )
    for span in embed_run[0]:
        a = span.attributes
        assert 0 < a[forward] <= a[execute] <= a["gen_ai.latency.time_in_model_inference"] + 1e-3
    for span in cross_encoder_run[0]:
        assert forward not in span.attributes and execute not in span.attributes
