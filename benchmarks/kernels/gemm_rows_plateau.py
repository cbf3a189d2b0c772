"""The prefill GEMMs' rate against the row count M: where does it stop growing on this CPU?

One "layer" is a model's four linear GEMMs (qkv, o, gate_up, down) as trillm runs them, at
SmolLM2-135M's shape (hidden 576, 9/3 heads of 64, intermediate 1536) and Llama-3.2-1B's
(hidden 2048, 32/8 heads of 64, intermediate 8192), for the bf16 weights (the native bf16
GEMM, ``linear_cpu.linear_bf16``) and Q4_0 weights with int8 activations (the VNNI kernel,
``linear_q_cpu.linear``; random blocks). Per M: the layer's wall time and its rate (GFLOP/s,
and relative to the largest M's), medians over ``--rounds`` rounds, each M timed in every
round in turn (on a shared machine the load moves between rounds, not within one M's
samples). The step budget (``--max-num-batched-tokens``) is worth shrinking only as far as
this rate holds.

    python benchmarks/kernels/gemm_rows_plateau.py --rows 128 256 512 1024 2048 4096 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trillm.kernels import linear_cpu, linear_q_cpu  # noqa: E402

# (hidden, q heads, kv heads, head dim, intermediate)
MODELS = {"smollm2-135m": (576, 9, 3, 64, 1536), "llama-3.2-1b": (2048, 32, 8, 64, 8192)}


def layer_shapes(model: str) -> list[tuple[int, int]]:
    """(K, N) of qkv, o, gate_up, down."""
    h, qh, kvh, d, inter = MODELS[model]
    return [(h, (qh + 2 * kvh) * d), (qh * d, h), (h, 2 * inter), (inter, h)]


def q4_0_weight(n: int, k: int, rng: np.random.Generator) -> linear_q_cpu.QuantizedWeight:
    blocks = k // linear_q_cpu.BLOCK
    raw = rng.integers(0, 256, size=(n, blocks, 18), dtype=np.uint8)
    raw[:, :, :2] = (
        np.full((n, blocks), 0.01, dtype=np.float16).view(np.uint8).reshape(n, blocks, 2)
    )
    return linear_q_cpu.QuantizedWeight(raw.reshape(n, blocks * 18), linear_q_cpu.Q4_0, n, k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--kinds", nargs="+", default=["bf16", "q4_0"], choices=["bf16", "q4_0"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    calls: dict[tuple[str, str], Any] = {}
    for model in args.models:
        shapes = layer_shapes(model)
        for kind in args.kinds:
            if kind == "bf16":
                ws = [
                    linear_cpu.PackedWeightBf16(torch.randn(n, k, generator=g).bfloat16())
                    for k, n in shapes
                ]

                def run(x: list[torch.Tensor], ws: list[Any] = ws) -> None:
                    for xi, w in zip(x, ws, strict=True):
                        linear_cpu.linear_bf16(xi, w)
            else:
                ws = [q4_0_weight(n, k, rng) for k, n in shapes]

                def run(x: list[torch.Tensor], ws: list[Any] = ws) -> None:
                    for xi, w in zip(x, ws, strict=True):
                        linear_q_cpu.linear(xi, w, int8_activations=True)

            calls[(model, kind)] = run
    samples: dict[tuple[str, str, int], list[float]] = {}
    load_start = os.getloadavg()
    for r in range(args.rounds):
        for (model, kind), run in calls.items():
            dtype = torch.bfloat16
            for m in args.rows:
                x = [torch.randn(m, k, generator=g).to(dtype) for k, _ in layer_shapes(model)]
                if r == 0:
                    run(x)  # warm-up
                t = time.perf_counter()
                run(x)
                samples.setdefault((model, kind, m), []).append(time.perf_counter() - t)
    rows = []
    print(f"threads {torch.get_num_threads()}, load {load_start} -> {os.getloadavg()}")
    print(f"{'model':14s} {'kind':5s} {'M':>5s} {'layer ms':>9s} {'GFLOP/s':>8s} {'rel':>5s}")
    for model in args.models:
        flop_per_row = sum(2.0 * k * n for k, n in layer_shapes(model))
        for kind in args.kinds:
            top = None
            for m in sorted(args.rows, reverse=True):
                t = statistics.median(samples[(model, kind, m)])
                rate = flop_per_row * m / t / 1e9
                top = top or rate
                rows.append(dict(model=model, kind=kind, m=m, ms=t * 1e3, gflops=rate))
            for row in sorted(
                (r for r in rows if r["model"] == model and r["kind"] == kind), key=lambda r: r["m"]
            ):
                rel = row["gflops"] / top
                print(
                    f"{model:14s} {kind:5s} {row['m']:5d} {row['ms']:9.2f}"
                    f" {row['gflops']:8.1f} {rel:5.2f}"
                )
    if args.out:
        args.out.write_text(
            json.dumps(
                dict(argv=sys.argv[1:], load=[load_start, os.getloadavg()], rows=rows), indent=1
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
