"""benchmarks/peers/peers_1b.py's results: the client figures a run keeps per server and the
table (``DIR/table.txt``) with trillm's best against the best peer, as ratios beside the
issue's targets."""

from __future__ import annotations

import argparse
from typing import Any

KEYS = (
    "completed",
    "failed",
    "duration",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "output_len_check",
    "input_len_check",
)


def pick(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r.get(k) for k in KEYS}


def render(summary: dict[str, Any], args: argparse.Namespace) -> str:
    cfg = summary.get("settings") or {}
    rows = [
        f"{cfg.get('shape', args.shape)}'s shape, KV budget {cfg.get('kv_gib', args.kv_gib)} GiB "
        "for every server",
        "server        c1 TTFT  c1 TPOT  c16 tok/s  c16 TTFT  c16 TPOT  c64 tok/s  c64 TTFT "
        f" {args.long_len} TTFT  lens  load before/after",
        "-" * 118,
    ]
    best: dict[str, dict[str, tuple[float, str]]] = {"trillm": {}, "peer": {}}
    metrics = (
        ("c1", "mean_tpot_ms", min),
        ("c16", "output_throughput", max),
        ("c16", "mean_ttft_ms", min),
        ("c64", "output_throughput", max),
        ("c64", "mean_ttft_ms", min),
        ("long", "ttft_ms", min),
    )
    for name, s in summary["servers"].items():
        if "error" in s and "c1" not in s:
            rows.append(f"{name:<12}  ERROR {s['error'][:90]}")
            continue

        def f(run: str, key: str, fmt: str = "{:.0f}", s: dict[str, Any] = s) -> str:
            v = (s.get(run) or {}).get(key)
            return fmt.format(v) if v is not None else "-"

        lens = all(
            (s.get(r) or {}).get("output_len_check", "ok") == "ok" for r in ("c1", "c16", "c64")
        )
        rows.append(
            f"{name:<12} {f('c1', 'mean_ttft_ms'):>8} {f('c1', 'mean_tpot_ms', '{:.1f}'):>8} "
            f"{f('c16', 'output_throughput', '{:.1f}'):>10} {f('c16', 'mean_ttft_ms'):>9} "
            f"{f('c16', 'mean_tpot_ms', '{:.1f}'):>9} {f('c64', 'output_throughput', '{:.1f}'):>10} "
            f"{f('c64', 'mean_ttft_ms'):>9} {f('long', 'ttft_ms'):>10}  "
            f"{'ok' if lens else 'BAD':<4}  {s['load_before']} / {s.get('load_after', '-')}"
        )
        side = "trillm" if name.startswith("trillm") else "peer"
        for run, key, better in metrics:
            v = (s.get(run) or {}).get(key)
            if v:
                old = best[side].get(f"{run} {key}")
                if old is None or better(v, old[0]) == v:
                    best[side][f"{run} {key}"] = (v, name)
    rows += [
        "(ms; tok/s = output tokens/s; TPOT = (E2E - TTFT) / (tokens - 1) per request, mean; "
        f"{args.in_len}-token prompts, {args.out_len} output tokens, ignore_eos, greedy; "
        "random weights)",
        "",
        "issue 38's targets, trillm's best against the best peer:",
    ]
    targets = {
        "c1 mean_tpot_ms": ("c1 TPOT", "<= 0.8"),
        "c16 output_throughput": ("c16 out tok/s", ">= 1.5"),
        "c16 mean_ttft_ms": ("c16 TTFT", "<= 0.8"),
        "c64 output_throughput": ("c64 out tok/s", ">= 1.5, as c16"),
        "c64 mean_ttft_ms": ("c64 TTFT", "<= 0.8, as c16"),
        "long ttft_ms": (f"{args.long_len} TTFT", "<= 0.8"),
    }
    for key, (label, goal) in targets.items():
        t, p = best["trillm"].get(key), best["peer"].get(key)
        if t and p:
            rows.append(
                f"  {label:<14} trillm {t[0]:.1f} ({t[1]}) / peer {p[0]:.1f} ({p[1]}) = "
                f"{t[0] / p[0]:.2f}  (target {goal})"
            )
    return "\n".join(rows) + "\n"
