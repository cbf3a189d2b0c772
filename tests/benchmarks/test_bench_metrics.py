"""Unit tests of the benchmark arithmetic: metrics, arrivals, datasets (no server)."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from bench_stub import write_sharegpt

from trillm.bench import datasets, metrics
from trillm.bench.metrics import RequestResult, Slos
from trillm.bench.serve import arrival_offsets
from trillm.bench.serve_flags import parse_percentiles, parse_rates

T0 = 1000.0  # benchmark start (perf_counter seconds)


def timeline(
    start: float, ttft: float, itl: list[float], tokens: int, prompt_len: int = 10
) -> RequestResult:
    """A finished request: sent at T0+start, first chunk after ttft, then the itl gaps."""
    return RequestResult(
        prompt_len=prompt_len,
        start_time=T0 + start,
        success=True,
        ttft=ttft,
        latency=ttft + sum(itl),
        itl=list(itl),
        output_tokens=tokens,
    )


@pytest.fixture
def three_requests() -> list[RequestResult]:
    # A: sent 0.0, chunks at 0.1, 0.3, 0.6 -> E2EL 0.6, 3 tokens, TPOT (0.6-0.1)/2 = 0.25
    # B: sent 0.2, chunks at 0.6, 1.4 (2 chunks, 4 tokens) -> E2EL 1.2, TPOT (1.2-0.4)/3
    # C: sent 1.5, one chunk at 1.7, 1 token -> E2EL 0.2, no TPOT
    return [
        timeline(0.0, 0.1, [0.2, 0.3], 3, prompt_len=10),
        timeline(0.2, 0.4, [0.8], 4, prompt_len=20),
        timeline(1.5, 0.2, [], 1, prompt_len=30),
    ]


def test_latency_metrics_by_hand(three_requests: list[RequestResult]) -> None:
    s = metrics.calculate_metrics(three_requests, duration=2.0, t0=T0, percentiles=[50, 99])
    assert s["completed"] == 3 and s["failed"] == 0
    ttfts_ms = [100.0, 400.0, 200.0]
    assert s["mean_ttft_ms"] == pytest.approx(sum(ttfts_ms) / 3)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    # p99 by linear interpolation between 200 (rank 1) and 400 (rank 2): 200 + 0.98 * 200
    assert s["p99_ttft_ms"] == pytest.approx(396.0)
    std = math.sqrt(sum((x - 700 / 3) ** 2 for x in ttfts_ms) / 3)
    assert s["std_ttft_ms"] == pytest.approx(std)
    tpots_ms = [250.0, 800.0 / 3]
    assert s["mean_tpot_ms"] == pytest.approx(sum(tpots_ms) / 2)
    itls_ms = [200.0, 300.0, 800.0]
    assert s["mean_itl_ms"] == pytest.approx(sum(itls_ms) / 3)
    assert s["median_itl_ms"] == pytest.approx(300.0)
    assert s["mean_e2el_ms"] == pytest.approx((600.0 + 1200.0 + 200.0) / 3)


def test_throughput_and_peaks_by_hand(three_requests: list[RequestResult]) -> None:
    s = metrics.calculate_metrics(three_requests, duration=2.0, t0=T0)
    assert s["total_input_tokens"] == 60
    assert s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(34.0)
    # Second [0,1): A's 3 chunks (1 token each) + B's first chunk (2 tokens) = 5;
    # second [1,2): B's second chunk (2) + C's chunk (1) = 3.
    assert s["max_output_tokens_per_s"] == pytest.approx(5.0)
    # A in flight [0, 0.6), B [0.2, 1.4), C [1.5, 1.7): at most 2 at once.
    assert s["max_concurrent_requests"] == 2
    assert s["request_goodput"] is None  # no SLO given


def test_failed_requests_are_counted_not_measured(three_requests: list[RequestResult]) -> None:
    failed = RequestResult(prompt_len=99, start_time=T0, error="HTTP 500: boom")
    s = metrics.calculate_metrics([*three_requests, failed], duration=2.0, t0=T0)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 60  # the failed prompt is not counted
    lists = metrics.per_request_lists([*three_requests, failed])
    assert lists["errors"][-1] == "HTTP 500: boom"
    assert lists["output_lens"] == [3, 4, 1, 0]


def test_goodput_counts_requests_meeting_every_slo(three_requests: list[RequestResult]) -> None:
    # TTFT <= 250 ms: A (100), C (200). TPOT <= 260 ms: A (250), C (1 token -> 0). So 2 good.
    slos = Slos(ttft_ms=250.0, tpot_ms=260.0)
    s = metrics.calculate_metrics(three_requests, duration=2.0, t0=T0, slos=slos)
    assert s["request_goodput"] == pytest.approx(1.0)
    # An E2EL limit of 500 ms leaves only C (200 ms).
    slos = Slos(ttft_ms=250.0, tpot_ms=260.0, e2el_ms=500.0)
    s = metrics.calculate_metrics(three_requests, duration=2.0, t0=T0, slos=slos)
    assert s["request_goodput"] == pytest.approx(0.5)


def test_peak_concurrency_end_before_start_at_same_instant() -> None:
    back_to_back = [timeline(0.0, 0.5, [0.5], 2), timeline(1.0, 0.5, [0.5], 2)]
    assert metrics.peak_concurrency(back_to_back) == 1
    nested = [timeline(0.0, 1.0, [2.0], 2), timeline(0.5, 0.1, [0.1], 2), timeline(0.6, 0.1, [], 1)]
    assert metrics.peak_concurrency(nested) == 3


def test_parse_goodput() -> None:
    slos = metrics.parse_goodput(["ttft:500", "tpot:50.5"])
    assert (slos.ttft_ms, slos.tpot_ms, slos.e2el_ms) == (500.0, 50.5, None)
    with pytest.raises(ValueError, match="Invalid --goodput item 'itl:5'"):
        metrics.parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="is not a number"):
        metrics.parse_goodput(["ttft:fast"])


def test_summary_table_has_vllm_layout(three_requests: list[RequestResult]) -> None:
    s = metrics.calculate_metrics(three_requests, duration=2.0, t0=T0)
    text = metrics.format_summary(s, percentile_metrics=["ttft", "itl"], percentiles=[99.0])
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert any(
        line.startswith("Successful requests:") and line.split()[-1] == "3" for line in lines
    )
    assert any(line.startswith("P99 TTFT (ms):") for line in lines)
    assert not any("TPOT" in line for line in lines)


def test_empty_run_is_all_zeros() -> None:
    s = metrics.calculate_metrics([], duration=0.0, t0=T0)
    assert s["completed"] == 0 and s["request_throughput"] == 0.0 and s["p99_ttft_ms"] == 0.0
    json.dumps(s)  # still serialisable


# --- arrivals -------------------------------------------------------------------------------


def test_poisson_arrivals_mean_and_variance() -> None:
    rng = np.random.default_rng(0)
    offsets = arrival_offsets(20001, rate=4.0, burstiness=1.0, rng=rng)
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.var() == pytest.approx(0.25**2, rel=0.06)  # exponential: var = mean^2


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_mean_scales_variance(burstiness: float) -> None:
    gaps = np.diff(arrival_offsets(20001, 2.0, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    # Gamma(k, 1/(rate k)): var = 1 / (rate^2 k)
    assert gaps.var() == pytest.approx(1.0 / (4.0 * burstiness), rel=0.1)


def test_infinite_rate_sends_all_at_once() -> None:
    assert np.array_equal(arrival_offsets(7, math.inf, 1.0, np.random.default_rng(0)), np.zeros(7))


def test_bad_rates_and_percentiles() -> None:
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "fast", "-1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_percentiles("0")
    with pytest.raises(ValueError, match="--burstiness must be positive"):
        arrival_offsets(3, 1.0, 0.0, np.random.default_rng(0))


# --- datasets --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> datasets.BenchTokenizer:
    return datasets.BenchTokenizer(
        datasets.Path(__file__).resolve().parents[2] / "trillm" / "default_model"
    )


def test_random_token_ids_within_range_ratio() -> None:
    reqs = datasets.build_random(200, 100, 20, range_ratio=0.5, prefix_len=7, seed=3)
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in reqs)
    assert min(in_lens) >= 7 + 50 and max(in_lens) <= 7 + 150
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    assert len(set(in_lens)) > 20  # lengths really vary
    prefix = reqs[0].prompt[:7]
    assert all(r.prompt[:7] == prefix for r in reqs)
    fixed = datasets.build_random(5, 16, 4, seed=3)
    assert [r.prompt_len for r in fixed] == [16] * 5 and [r.expected_output_len for r in fixed] == [
        4
    ] * 5


def test_random_text_prompts_have_their_measured_length(tokenizer: datasets.BenchTokenizer) -> None:
    reqs = datasets.build_random(10, 40, 8, seed=0, tokenizer=tokenizer, as_text=True)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len
        assert abs(r.prompt_len - 40) <= 4


def test_random_range_ratio_must_be_below_one() -> None:
    with pytest.raises(datasets.DatasetError, match="--random-range-ratio"):
        datasets.build_random(2, 10, 10, range_ratio=1.0)


def test_prefix_repetition_shares_prefixes() -> None:
    reqs = datasets.build_prefix_repetition(12, 8, 5, 3, 6, seed=0)
    assert all(r.prompt_len == 13 and r.expected_output_len == 6 for r in reqs)
    prefixes = {tuple(r.prompt[:8]) for r in reqs}
    assert len(prefixes) == 3
    assert len({tuple(r.prompt[8:]) for r in reqs}) == 12


def test_sharegpt_first_turn_and_filter(
    tmp_path: datasets.Path, tokenizer: datasets.BenchTokenizer
) -> None:
    long_reply = " ".join(["word"] * 3000)
    pairs = [
        ("What is the capital of France, and why?", "Paris is the capital of France for history."),
        ("Hi", "Hello there, how can I help you today?"),  # prompt too short
        ("Tell me a story about a dragon please.", "Ok"),  # reply too short
        ("Write a very long essay about the sea.", long_reply),  # too long in total
        ("Explain the theory of relativity simply.", "Space and time bend around mass."),
    ]
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path, pairs)
    reqs = datasets.build_sharegpt(path, 10, tokenizer, seed=0)
    got = {r.prompt: r for r in reqs}
    assert set(got) == {pairs[0][0], pairs[4][0]}
    for q, a in (pairs[0], pairs[4]):
        assert got[q].prompt_len == len(tokenizer.encode(q))
        assert got[q].expected_output_len == len(tokenizer.encode(a))
    limited = datasets.build_sharegpt(path, 1, tokenizer, output_len=5)
    assert len(limited) == 1 and limited[0].expected_output_len == 5


def test_sharegpt_errors_name_the_problem(
    tmp_path: datasets.Path, tokenizer: datasets.BenchTokenizer
) -> None:
    with pytest.raises(datasets.DatasetError, match="ShareGPT file not found"):
        datasets.build_sharegpt(tmp_path / "missing.json", 3, tokenizer)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(datasets.DatasetError, match="not valid JSON"):
        datasets.build_sharegpt(bad, 3, tokenizer)


def test_missing_tokenizer_is_a_clear_error(tmp_path: datasets.Path) -> None:
    with pytest.raises(datasets.DatasetError, match="Tokenizer folder not found"):
        datasets.BenchTokenizer(tmp_path / "nope")
    assert datasets.find_tokenizer(None, str(tmp_path)) is None  # a folder without a tokenizer
    assert datasets.find_tokenizer(None, "some-hub/model-name") is None
