"""Serving metrics as vLLM defines them, from per-request timelines.

Times inside ``RequestResult`` are seconds; the summary keys ending in ``_ms`` are milliseconds.
- TTFT: request sent -> first chunk that carries generated text.
- ITL: every gap between consecutive text chunks (a chunk may carry several tokens).
- TPOT: (E2EL - TTFT) / (output_tokens - 1), per request with more than one output token.
- E2EL: request sent -> last byte of the response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass(slots=True)
class RequestResult:
    """One request's timeline, filled by the client as the stream arrives."""

    prompt_len: int
    start_time: float = 0.0  # perf_counter when the request was sent
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, E2EL
    itl: list[float] = field(default_factory=list)  # seconds, one per chunk after the first
    output_tokens: int = 0
    generated_text: str = ""

    def chunk_times(self) -> list[float]:
        """Absolute arrival time of every text chunk."""
        times = [self.start_time + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


@dataclass(slots=True)
class Slos:
    """Goodput service-level objectives in milliseconds (--goodput ttft:MS tpot:MS e2el:MS)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def parse_goodput(items: list[str] | None) -> Slos:
    slos = Slos()
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"Invalid --goodput item {item!r}; use ttft:MS, tpot:MS or e2el:MS.")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(
                f"Invalid --goodput value in {item!r}: {value!r} is not a number."
            ) from None
        if ms < 0:
            raise ValueError(f"Invalid --goodput value in {item!r}: must be non-negative.")
        setattr(slos, f"{name}_ms", ms)
    return slos


def request_tpot(r: RequestResult) -> float | None:
    """TPOT of one request, None when it produced at most one token."""
    if r.output_tokens <= 1:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def meets_slos(r: RequestResult, slos: Slos) -> bool:
    # NOTE: as vLLM, a request with one output token has TPOT 0 for goodput.
    tpot = request_tpot(r) or 0.0
    checks = ((slos.ttft_ms, r.ttft), (slos.tpot_ms, tpot), (slos.e2el_ms, r.latency))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at one instant (a request ending at t is gone before one starts)."""
    events = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    events.sort()  # at equal times -1 sorts before +1
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def peak_output_tokens_per_s(results: list[RequestResult], t0: float) -> float:
    """Most output tokens in any one-second bucket [t0 + k, t0 + k + 1).

    A request's tokens are spread evenly over its chunks: servers do not say how many tokens
    each chunk carries, only the total (usage).
    """
    buckets: dict[int, float] = {}
    for r in results:
        times = r.chunk_times()
        per_chunk = r.output_tokens / len(times)
        for t in times:
            k = int(np.floor(t - t0))
            buckets[k] = buckets.get(k, 0.0) + per_chunk
    return max(buckets.values(), default=0.0)


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = ms.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(np.mean(ms)),
        f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{name}_ms": 0.0 if empty else float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def metric_values(ok: list[RequestResult], metric: str) -> list[float]:
    if metric == "ttft":
        return [r.ttft for r in ok]
    if metric == "tpot":
        return [t for r in ok if (t := request_tpot(r)) is not None]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl]
    return [r.latency for r in ok]


def calculate_metrics(
    results: list[RequestResult],
    duration: float,
    t0: float,
    *,
    slos: Slos | None = None,
    percentiles: list[float] | None = None,
) -> dict[str, Any]:
    """The summary dict, with vLLM's key names. ``t0``: perf_counter at the benchmark start."""
    percentiles = [99.0] if percentiles is None else percentiles
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": peak_output_tokens_per_s(ok, t0),
        "max_concurrent_requests": peak_concurrency(ok),
    }
    if slos is not None and slos.any():
        summary["request_goodput"] = per_s(sum(meets_slos(r, slos) for r in ok))
    for metric in METRICS:
        summary.update(_stats(metric, metric_values(ok, metric), percentiles))
    return summary


def per_request_lists(results: list[RequestResult]) -> dict[str, list[Any]]:
    """The raw per-request lists vLLM saves beside the summary (seconds)."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


def format_summary(
    summary: dict[str, Any],
    *,
    percentile_metrics: list[str],
    percentiles: list[float],
    title: str = "Serving Benchmark Result",
) -> str:
    """vLLM's '============ Serving Benchmark Result ============' table."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        text = "n/a" if value is None else (f"{value:{fmt}}" if fmt else str(value))
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", summary["completed"], "")
    row("Failed requests:", summary["failed"], "")
    if "max_concurrency" in summary:
        row("Maximum request concurrency:", summary["max_concurrency"], "")
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"], "")
    row("Total generated tokens:", summary["total_output_tokens"], "")
    row("Request throughput (req/s):", summary["request_throughput"])
    if summary["request_goodput"] is not None:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"])
    row("Peak concurrent requests:", summary["max_concurrent_requests"], "")
    row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    for metric in percentile_metrics:
        lines.append(f"{' ' + METRIC_NAMES[metric] + ' ':-^50}")
        row(f"Mean {metric.upper()} (ms):", summary[f"mean_{metric}_ms"])
        row(f"Median {metric.upper()} (ms):", summary[f"median_{metric}_ms"])
        for p in percentiles:
            row(f"P{p:g} {metric.upper()} (ms):", summary[f"p{p:g}_{metric}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)
