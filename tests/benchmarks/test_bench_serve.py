"""End-to-end tests of ``python -m trillm.bench serve`` against live servers: the stub
(``tests/support/bench_stub.py``: deterministic chunks with known delays, so TTFT/ITL can be
checked against the delays it sleeps) and a real ``trillm serve``.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_stub import (
    FIRST_DELAY_S,
    GAP_S,
    MODEL,
    REPO,
    SERVE_KEYS,
    StubServer,
    bench_env,
    common_args,
    load,
    run_bench,
    run_bench_process,
    write_sharegpt,
)
from server_harness import ServerProcess, free_port


@pytest.mark.parametrize("http_client", ["h11", "httpx"])
def test_stub_completions_metrics_match_known_delays(tmp_path: Path, http_client: str) -> None:
    n, out_len = 6, 5
    with StubServer() as stub:
        proc = run_bench_process(
            common_args(stub.url, tmp_path, n, out_len) + ["--http-client", http_client]
        )
        bodies = stub.bodies
    assert proc.returncode == 0, proc.stderr
    assert "ResourceWarning" not in proc.stderr, proc.stderr  # each stream closed, not collected
    assert "============ Serving Benchmark Result ============" in proc.stdout
    # the client's own heap is out of the collector before the load (its pauses would be
    # measured as the server's latency)
    frozen = re.search(r"Froze (\d+) startup objects out of the garbage collector", proc.stdout)
    assert frozen is not None and int(frozen.group(1)) > 10_000, proc.stdout
    r = load(tmp_path / "r.json")
    assert set(SERVE_KEYS) <= set(r)
    assert r["completed"] == n and r["failed"] == 0 and r["model_id"] == MODEL
    assert r["total_input_tokens"] == n * 16 and r["input_lens"] == [16] * n
    assert r["total_output_tokens"] == n * out_len and r["output_lens"] == [out_len] * n
    # The requests: n + the test request, streamed with usage, token-id prompts of 16 ids.
    assert len(bodies) == n + 1
    for body in bodies[1:]:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == out_len and len(body["prompt"]) == 16
    # Timing against the stub's sleeps: TTFT >= its first delay; ITL around its gap.
    assert min(r["ttfts"]) >= FIRST_DELAY_S
    assert r["mean_ttft_ms"] < (FIRST_DELAY_S + 1.0) * 1000
    assert all(len(itl) == out_len - 1 for itl in r["itls"])
    assert 0.5 * GAP_S * 1000 <= r["median_itl_ms"] <= GAP_S * 1000 + 200
    assert r["mean_tpot_ms"] == pytest.approx(
        (r["mean_e2el_ms"] - r["mean_ttft_ms"]) / (out_len - 1)
    )
    span = (out_len - 1) * GAP_S
    assert span * 1000 - 20 <= r["mean_tpot_ms"] * (out_len - 1) <= span * 1000 + 500
    # Internal consistency: E2EL = TTFT + sum(ITL) + the tail after the last chunk (tiny).
    e2el_ms = r["mean_e2el_ms"]
    chunk_span_ms = 1000 * (sum(r["ttfts"]) + sum(map(sum, r["itls"]))) / n
    assert chunk_span_ms <= e2el_ms <= chunk_span_ms + 200
    assert r["request_throughput"] == pytest.approx(n / r["duration"])
    assert r["max_concurrent_requests"] == n  # rate inf: all in flight together
    assert r["generated_texts"][0] == "".join(f"t{i} " for i in range(out_len))


def test_hundreds_of_concurrent_streams(tmp_path: Path) -> None:
    n, out_len = 300, 20  # each stream lasts >= 0.2 + 19 * 0.05 s: a burst overlaps fully
    with StubServer() as stub:
        proc = run_bench(common_args(stub.url, tmp_path, n, out_len), timeout=300)
    assert proc.returncode == 0, proc.output
    r = load(tmp_path / "r.json")
    assert r["completed"] == n and r["failed"] == 0
    assert r["max_concurrent_requests"] == n
    assert r["total_output_tokens"] == n * out_len


def test_max_concurrency_caps_streams_in_flight(tmp_path: Path) -> None:
    with StubServer() as stub:
        args = common_args(stub.url, tmp_path, 6, 3) + ["--max-concurrency", "2"]
        proc = run_bench(args)
    assert proc.returncode == 0, proc.output
    r = load(tmp_path / "r.json")
    assert r["completed"] == 6 and r["max_concurrency"] == 2
    assert r["max_concurrent_requests"] == 2
    # Three waves of two, each >= FIRST_DELAY + 2 * GAP long.
    assert r["duration"] >= 3 * (FIRST_DELAY_S + 2 * GAP_S)
    assert "Maximum request concurrency:" in proc.output


def test_chunks_carrying_several_tokens(tmp_path: Path) -> None:
    n, out_len = 3, 6
    with StubServer(tokens_per_chunk=2) as stub:
        proc = run_bench(common_args(stub.url, tmp_path, n, out_len))
    assert proc.returncode == 0, proc.output
    r = load(tmp_path / "r.json")
    assert r["output_lens"] == [out_len] * n  # from usage, not from the 3 chunks
    assert all(len(itl) == 2 for itl in r["itls"])
    # TPOT divides by tokens - 1 = 5, not by chunks - 1 = 2 (the mean is linear).
    assert r["mean_tpot_ms"] == pytest.approx((r["mean_e2el_ms"] - r["mean_ttft_ms"]) / 5)


def test_no_usage_counts_chunks(tmp_path: Path) -> None:
    with StubServer(tokens_per_chunk=2, send_usage=False) as stub:
        proc = run_bench(common_args(stub.url, tmp_path, 2, 6))
    assert proc.returncode == 0, proc.output
    assert load(tmp_path / "r.json")["output_lens"] == [3, 3]  # no usage, no tokenizer


def test_chat_sweep_goodput_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    args = common_args("", tmp_path, 4, 3, name="sweep.json")[2:]
    with StubServer() as stub:
        proc = run_bench(
            [
                "--base-url",
                stub.url,
                "--backend",
                "openai-chat",
                *args,
                "--tokenizer",
                str(REPO / "trillm" / "default_model"),
                "--request-rate",
                "10,inf",
                "--goodput",
                "ttft:100000",
                "e2el:1",
                "--metric-percentiles",
                "50,99",
                "--percentile-metrics",
                "ttft,tpot,itl,e2el",
                "--plot",
                str(png),
            ]
        )
        chat_bodies = [b for b in stub.bodies if "messages" in b]
    assert proc.returncode == 0, proc.output
    assert len(chat_bodies) == 1 + 2 * 4
    assert all(isinstance(b["messages"][0]["content"], str) for b in chat_bodies)
    for rate in ("10.0", "inf"):
        r = load(tmp_path / f"sweep-{rate}qps.json")
        assert r["completed"] == 4 and r["request_rate"] == (10.0 if rate == "10.0" else "inf")
        assert r["request_goodput"] == 0.0  # no request ends within 1 ms
        assert "p50_e2el_ms" in r and "p99_itl_ms" in r
        # The role-only first chunk is not a token: TTFT waits for the content.
        assert min(r["ttfts"]) >= FIRST_DELAY_S
    assert png.stat().st_size > 10_000
    assert proc.output.count("Serving Benchmark Result") == 2


def test_sharegpt_dataset_against_stub(tmp_path: Path) -> None:
    from trillm.bench.datasets import BenchTokenizer

    tok_dir = REPO / "trillm" / "default_model"
    pairs = [
        (
            "How do volcanoes form under the ocean floor?",
            "Magma rises through cracks in the crust.",
        ),
        ("Name three colours of the rainbow please.", "Red, orange and yellow are three of them."),
    ]
    data = tmp_path / "sg.json"
    write_sharegpt(data, pairs)
    dataset = [
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(data),
        "--tokenizer",
        str(tok_dir),
    ]
    with StubServer() as stub:
        args = common_args(stub.url, tmp_path, 5, 1) + dataset + ["--no-oversample"]
        proc = run_bench(args)
        bodies = stub.bodies[1:]
    assert proc.returncode == 0, proc.output
    r = load(tmp_path / "r.json")
    tok = BenchTokenizer(tok_dir)
    expected = {q: (len(tok.encode(q)), len(tok.encode(a))) for q, a in pairs}
    assert r["completed"] == 2  # only two conversations in the file (--no-oversample)
    assert sorted(r["input_lens"]) == sorted(v[0] for v in expected.values())
    assert sorted(b["max_tokens"] for b in bodies) == sorted(v[1] for v in expected.values())
    assert {b["prompt"] for b in bodies} == set(expected)


def test_failed_requests_are_counted_and_listed(tmp_path: Path) -> None:
    # Request 1 is the test request; of the 6 benchmark requests, #3 and #6 (overall) fail.
    with StubServer(fail_every=3) as stub:
        proc = run_bench(common_args(stub.url, tmp_path, 6, 2))
    assert proc.returncode == 0, proc.output
    r = load(tmp_path / "r.json")
    assert r["failed"] == 2 and r["completed"] == 4
    assert sum("HTTP 500" in e for e in r["errors"]) == 2
    assert "2 request(s) failed" in proc.output and "stub failure" in proc.output


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = run_bench(common_args(url, tmp_path, 2, 2))
    assert proc.returncode == 1
    assert f"Cannot reach the server at {url}" in proc.output
    assert not (tmp_path / "r.json").exists()


def test_wrong_model_fails_the_test_request(tmp_path: Path) -> None:
    with StubServer() as stub:
        proc = run_bench([*common_args(stub.url, tmp_path, 2, 2), "--model", "nope"])
    assert proc.returncode == 1
    assert "The test request" in proc.output and "HTTP 404" in proc.output


def test_bad_flags_exit_nonzero(tmp_path: Path) -> None:
    proc = run_bench(["--request-rate", "fast"])
    assert proc.returncode == 2 and "invalid request rate 'fast'" in proc.output
    proc = run_bench(["--dataset-name", "sharegpt", "--base-url", "http://127.0.0.1:1"])
    assert proc.returncode == 1 and "needs --dataset-path" in proc.output


def test_sigint_reports_and_saves_completed_requests(tmp_path: Path) -> None:
    with StubServer() as stub:
        args = [*common_args(stub.url, tmp_path, 40, 10, name="int.json"), "--request-rate", "4"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "trillm.bench", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=bench_env(),
        )
        # Wait until the benchmark has been running long enough for some requests to finish.
        deadline = time.monotonic() + 60
        while len(stub.bodies) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Serving Benchmark Result (interrupted)" in out
    r = load(tmp_path / "int.json")
    assert r["interrupted"] is True
    assert 0 < r["completed"] < 40 and len(r["input_lens"]) == r["completed"] + r["failed"]


# --- against the real `trillm serve` ----------------------------------------------------------


@pytest.fixture(scope="module")
def trillm_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory):
    model = Path(tiny_model_factory("llama"))
    args = [
        str(model),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "64MiB",
        "--served-model-name",
        "tiny",
    ]
    server = ServerProcess(args, tmp_path_factory.mktemp("trillm_serve") / "server.log")
    server.start(timeout=240)
    try:
        yield server.url, model
    finally:
        server.stop()


def test_real_server_completions(trillm_server, tmp_path: Path) -> None:
    url, _ = trillm_server
    n, out_len = 4, 4
    proc = run_bench(common_args(url, tmp_path, n, out_len) + ["--ignore-eos"], timeout=300)
    assert proc.returncode == 0, proc.output
    r = load(tmp_path / "r.json")
    assert set(SERVE_KEYS) <= set(r)
    assert r["model_id"] == "tiny"  # taken from /v1/models
    assert r["completed"] == n and r["failed"] == 0
    assert r["input_lens"] == [16] * n and r["total_input_tokens"] == 16 * n
    assert r["output_lens"] == [out_len] * n  # ignore_eos: exactly max_tokens, from usage
    assert all(t > 0 for t in r["ttfts"]) and r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert r["mean_tpot_ms"] == pytest.approx(
        (r["mean_e2el_ms"] - r["mean_ttft_ms"]) / (out_len - 1)
    )


def test_real_server_chat_with_tokenizer(trillm_server, tmp_path: Path) -> None:
    url, model = trillm_server
    # --model a local folder: its tokenizer makes the text prompts; the API name differs.
    args = common_args(url, tmp_path, 3, 3) + ["--backend", "openai-chat", "--model", str(model)]
    args += ["--served-model-name", "tiny"]
    proc = run_bench(args + ["--ignore-eos"], timeout=300)
    assert proc.returncode == 0, proc.output
    r = load(tmp_path / "r.json")
    assert r["completed"] == 3 and r["endpoint"] == "/v1/chat/completions"
    assert r["model_id"] == "tiny" and r["tokenizer_id"] == str(model)
    assert r["output_lens"] == [3, 3, 3]


def test_real_server_takes_the_vllm_request_flags(trillm_server, tmp_path: Path) -> None:
    # The bodies these flags shape (tests/benchmarks/test_bench_serve_flags.py) are ones trillm serves:
    # request ids, penalties and min_p, --extra-body (ignore_eos: exact output lengths).
    url, _ = trillm_server
    args = common_args(url, tmp_path, 3, 4) + [
        "--num-warmups",
        "2",
        "--request-id-prefix",
        "real-",
        "--min-p",
        "0.05",
        "--repetition-penalty",
        "1.1",
        "--frequency-penalty",
        "0.1",
        "--presence-penalty",
        "0.1",
        "--extra-body",
        '{"ignore_eos": true}',
        "--metadata",
        "run=ci",
    ]
    proc = run_bench(args, timeout=300)
    assert proc.returncode == 0, proc.output
    r = load(tmp_path / "r.json")
    assert r["completed"] == 3 and r["failed"] == 0 and r["run"] == "ci"
    assert r["output_lens"] == [4, 4, 4]  # ignore_eos from --extra-body
