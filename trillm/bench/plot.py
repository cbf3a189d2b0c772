"""``--plot F.png``: latency CDFs, output throughput over time and, for a sweep, TTFT vs rate."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trillm.bench.metrics import RequestResult, metric_values

CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


def _label(rate: float) -> str:
    return "rate inf" if math.isinf(rate) else f"rate {rate:g}/s"


def _cdf(ax: Any, values_s: list[float], label: str) -> None:
    if not values_s:
        return
    ms = np.sort(np.asarray(values_s)) * 1000.0
    ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=label)


def throughput_series(results: list[RequestResult], t0: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-second output tokens: (bucket edges [k+1], tokens in each second [k])."""
    ok = [r for r in results if r.success]
    if not ok:
        return np.zeros(0), np.zeros(0)
    times = [
        (t - t0, r.output_tokens / len(ts)) for r in ok for ts in [r.chunk_times()] for t in ts
    ]
    last = int(max(t for t, _ in times)) + 1
    buckets = np.zeros(last)
    for t, w in times:
        buckets[int(max(t, 0.0))] += w
    return np.arange(last + 1, dtype=float), buckets


def concurrency_series(results: list[RequestResult], t0: float) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight, as a step function of time since the start."""
    events = sorted(
        [(r.start_time - t0, 1) for r in results if r.success]
        + [(r.start_time + r.latency - t0, -1) for r in results if r.success]
    )
    xs, ys, level = [0.0], [0], 0
    for t, d in events:
        level += d
        xs.append(t)
        ys.append(level)
    return np.asarray(xs), np.asarray(ys)


def _sweep_panel(ax: Any, runs: list[tuple[Any, dict[str, Any]]]) -> None:
    finite = [s.rate for s, _ in runs if not math.isinf(s.rate)]
    inf_x = max(finite) * 2 if finite else 1.0
    xs = [inf_x if math.isinf(s.rate) else s.rate for s, _ in runs]
    p_keys = [k for k in runs[0][1] if k.startswith("p") and k.endswith("_ttft_ms")]
    p_key = max(p_keys, key=lambda k: float(k[1:].split("_")[0]), default=None)
    ax.plot(xs, [rec["mean_ttft_ms"] for _, rec in runs], "o-", label="mean TTFT")
    if p_key:
        ax.plot(xs, [rec[p_key] for _, rec in runs], "s--", label=p_key.split("_")[0] + " TTFT")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(xs, [("inf" if math.isinf(s.rate) else f"{s.rate:g}") for s, _ in runs])
    ax.set(title="TTFT vs request rate", xlabel="request rate (req/s)", ylabel="ms")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def plot_runs(runs: list[tuple[Any, dict[str, Any]]], path: str) -> None:
    """``runs``: (RunState, record) per request rate, as ``serve`` produces them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    cdf_axes = [axes[0, 0], axes[0, 1], axes[0, 2], axes[1, 0]]
    for ax, (metric, title) in zip(cdf_axes, CDF_METRICS):
        for state, _ in runs:
            _cdf(
                ax,
                metric_values([r for r in state.results if r.success], metric),
                _label(state.rate),
            )
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    ax = axes[1, 1]
    for state, _ in runs:
        edges, tokens = throughput_series(state.results, state.t0)
        if tokens.size:
            ax.stairs(tokens, edges, label=_label(state.rate))
    ax.set(
        title="Output throughput over time (1 s buckets)", xlabel="s since start", ylabel="tokens/s"
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=8)
        _sweep_panel(axes[1, 2], runs)
    else:
        state = runs[0][0]
        xs, ys = concurrency_series(state.results, state.t0)
        axes[1, 2].step(xs, ys, where="post")
        axes[1, 2].set(title="Requests in flight", xlabel="s since start", ylabel="requests")
        axes[1, 2].grid(alpha=0.3)
    fig.suptitle(f"trillm bench serve: {runs[0][1].get('model_id', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
