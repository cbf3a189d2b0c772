"""/metrics against vLLM's v1 metric table (issue 16): a real server (near-zero-cost model),
a few requests, the page parsed with prometheus_client's parser; each name, type and label
checked under ``vllm:`` and ``trillm:``, counting consistent per engine request."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess

FAKE = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]
NAME = "served-name"

# vLLM v1's metrics (docs/design/metrics.md "v1 Metrics", vllm/v1/metrics/loggers.py), as
# exposed: name, type, labels beyond model_name and engine. mm_cache_* (multimodal models),
# spec_decode_* (features of other issues) are out of scope; lora_requests_info (only with
# --enable-lora): tests/entrypoints/test_lora_http.py.
VLLM_V1_TABLE = [
    ("vllm:num_requests_running", "gauge", ()),
    ("vllm:num_requests_waiting", "gauge", ()),
    ("vllm:kv_cache_usage_perc", "gauge", ()),
    ("vllm:prefix_cache_queries_total", "counter", ()),
    ("vllm:prefix_cache_hits_total", "counter", ()),
    ("vllm:num_preemptions_total", "counter", ()),
    ("vllm:prompt_tokens_total", "counter", ()),
    ("vllm:generation_tokens_total", "counter", ()),
    ("vllm:iteration_tokens_total", "histogram", ()),
    ("vllm:cache_config_info", "gauge", ("block_size", "enable_prefix_caching")),
    ("vllm:request_success_total", "counter", ("finished_reason",)),
    ("vllm:request_prompt_tokens", "histogram", ()),
    ("vllm:request_generation_tokens", "histogram", ()),
    ("vllm:request_params_n", "histogram", ()),
    ("vllm:request_params_max_tokens", "histogram", ()),
    ("vllm:time_to_first_token_seconds", "histogram", ()),
    ("vllm:inter_token_latency_seconds", "histogram", ()),
    ("vllm:e2e_request_latency_seconds", "histogram", ()),
    ("vllm:request_queue_time_seconds", "histogram", ()),
    ("vllm:request_inference_time_seconds", "histogram", ()),
    ("vllm:request_prefill_time_seconds", "histogram", ()),
    ("vllm:request_decode_time_seconds", "histogram", ()),
    ("vllm:request_time_per_output_token_seconds", "histogram", ()),
]


def families(text: str) -> dict[str, object]:
    """Family name as exposed (a counter keeps its ``_total``) -> family."""
    out = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = fam
    return out


def value(fams: dict, name: str, suffix: str = "", **labels: str) -> float:
    fam = fams[name]
    sample_name = name if fam.type == "counter" else name + suffix
    return sum(
        s.value
        for s in fam.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("metrics-vllm") / "server.log"
    srv = ServerProcess([*FAKE, "--served-model-name", NAME, "--disable-log-stats"], log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def scraped(server):
    """Requests of every shape, then the /metrics page once all have ended."""
    url = server.base_url
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    assert httpx.post(url + "/chat/completions", json=chat, timeout=60).status_code == 200
    body = {"prompt": ["one two", "three"], "max_tokens": 4, "n": 2}  # 2 prompts x n = 2
    assert httpx.post(url + "/completions", json=body, timeout=60).status_code == 200
    stream = {"prompt": "streamed", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", url + "/completions", json=stream, timeout=60) as r:
        assert b"[DONE]" in r.read()
    # A client gone mid-stream: its two samples end as aborted.
    gone = {
        "prompt": "gone",
        "max_tokens": 1800,
        "ignore_eos": True,
        "n": 2,
        "logprobs": 20,
        "stream": True,
    }
    with httpx.stream("POST", url + "/completions", json=gone, timeout=60) as r:
        chunks = r.iter_bytes()
        next(chunks)
    # 1 + 4 + 1 + 2 engine requests end: wait for the aborted ones.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        fams = families(httpx.get(server.url + "/metrics").text)
        if value(fams, "vllm:request_success_total") >= 8:
            break
        time.sleep(0.1)
    return httpx.get(server.url + "/metrics").text


@pytest.mark.parametrize("prefix", ["vllm:", "trillm:"])
@pytest.mark.parametrize("name,kind,extra", VLLM_V1_TABLE, ids=[r[0] for r in VLLM_V1_TABLE])
def test_every_vllm_v1_metric_with_its_type_and_labels(scraped, prefix, name, kind, extra):
    fams = families(scraped)
    exposed = prefix + name.split(":", 1)[1]
    assert exposed in fams, f"{exposed} missing"
    fam = fams[exposed]
    assert fam.type == kind
    assert fam.samples
    for sample in fam.samples:
        assert sample.labels["engine"] == "0"
        if name != "vllm:cache_config_info":  # vLLM: the config's fields, no model name
            assert sample.labels["model_name"] == NAME
        for label in extra:
            assert label in sample.labels
    if kind == "histogram":
        suffixes = {s.name[len(exposed) :] for s in fam.samples}
        assert suffixes == {"_bucket", "_sum", "_count"}


def test_counting_is_per_engine_request_and_consistent(scraped):
    fams = families(scraped)
    success = value(fams, "vllm:request_success_total")
    assert success == 8  # 1 chat + 2 prompts x n=2 + 1 stream + 2 aborted samples
    assert value(fams, "vllm:request_success_total", finished_reason="abort") == 2
    assert value(fams, "vllm:request_success_total", finished_reason="length") == 6
    for hist in (
        "e2e_request_latency_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert value(fams, f"vllm:{hist}", "_count") == success, hist
    assert value(fams, "vllm:generation_tokens_total") == value(
        fams, "vllm:request_generation_tokens", "_sum"
    )
    # Every sample here produced tokens: one TTFT each, prompt tokens counted at first token.
    assert value(fams, "vllm:time_to_first_token_seconds", "_count") == success
    assert value(fams, "vllm:prompt_tokens_total") == value(
        fams, "vllm:request_prompt_tokens", "_sum"
    )
    assert value(fams, "vllm:request_decode_time_seconds", "_count") == success
    assert value(fams, "vllm:inter_token_latency_seconds", "_count") > 0
    # n and max_tokens: once per prompt of an accepted request (1 + 2 + 1 + 1).
    assert value(fams, "vllm:request_params_n", "_count") == 5
    assert value(fams, "vllm:request_params_n", "_sum") == 1 + 2 * 2 + 1 + 2
    assert value(fams, "vllm:request_params_max_tokens", "_sum") == 5 + 2 * 4 + 6 + 1800
    # The two prefixes are the same series.
    for name in ("request_success_total", "generation_tokens_total"):
        assert value(fams, f"vllm:{name}") == value(fams, f"trillm:{name}")
    # The engine's first P1 of each request: the 6 samples that ended on their own (the
    # aborted ones end without an engine output) have a queue, prefill and inference time.
    for name in ("queue", "prefill", "inference"):
        assert value(fams, f"vllm:request_{name}_time_seconds", "_count") == 6, name
    assert value(fams, "vllm:request_queue_time_seconds", "_sum") + value(
        fams, "vllm:request_prefill_time_seconds", "_sum"
    ) <= value(fams, "vllm:e2e_request_latency_seconds", "_sum")
    # Each step's computed tokens: every prompt token not served by the prefix cache, plus
    # every token fed back (at least those delivered; the aborted samples may have computed
    # more than their client read).
    steps = value(fams, "vllm:iteration_tokens_total", "_count")
    assert steps > 0
    fed_back = value(fams, "vllm:generation_tokens_total") - success
    computed = value(fams, "vllm:prompt_tokens_total") - value(fams, "vllm:prefix_cache_hits_total")
    assert value(fams, "vllm:iteration_tokens_total", "_sum") >= computed + fed_back
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert value(fams, "vllm:num_requests_running") == 0
    assert value(fams, "vllm:num_requests_waiting") == 0


def test_metrics_prefix_vllm_only(tmp_path):
    srv = ServerProcess(
        [*FAKE, "--metrics-prefix", "vllm", "--disable-log-stats"], tmp_path / "server.log"
    ).start()
    try:
        httpx.post(srv.base_url + "/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        fams = families(httpx.get(srv.url + "/metrics").text)
    finally:
        assert srv.stop() == 0
    assert not [n for n in fams if n.startswith("trillm:")]
    assert {row[0] for row in VLLM_V1_TABLE} <= set(fams)
    assert value(fams, "vllm:request_success_total") == 1


def test_http_and_process_series_as_vllm(scraped):
    """prometheus_fastapi_instrumentator's http_* series and prometheus_client's process_*."""
    fams = families(scraped)
    assert fams["http_requests_total"].type == "counter"
    assert (
        value(fams, "http_requests_total", handler="/v1/completions", method="POST", status="2xx")
        == 3
    )
    assert value(fams, "http_requests_total", handler="/v1/chat/completions", status="2xx") == 1
    assert value(fams, "http_requests_total", handler="/metrics", method="GET") >= 1
    durations = fams["http_request_duration_seconds"]
    assert durations.type == "histogram"
    assert {s.labels.get("handler") for s in durations.samples} >= {"/v1/completions"}
    assert (
        value(
            fams,
            "http_request_duration_seconds",
            "_count",
            handler="/v1/completions",
            method="POST",
        )
        == 3
    )
    assert fams["http_request_duration_highr_seconds"].type == "histogram"
    for name in ("http_request_size_bytes", "http_response_size_bytes"):
        assert fams[name].type == "summary"
        assert value(fams, name, "_sum", handler="/v1/completions") > 0
    for name in ("process_resident_memory_bytes", "process_open_fds", "python_info"):
        assert name in fams


def test_unknown_paths_share_one_handler_label(server):
    for i in range(3):
        assert httpx.get(f"{server.url}/no/such/path/{i}").status_code == 404
    fams = families(httpx.get(server.url + "/metrics").text)
    handlers = {s.labels["handler"] for s in fams["http_requests_total"].samples}
    assert "none" in handlers and not any(h.startswith("/no/") for h in handlers)
