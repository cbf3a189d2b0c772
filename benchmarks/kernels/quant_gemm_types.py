"""The quantized GEMM by GGML type at the same shapes: Q4_1 / Q4_K / Q3_K / Q2_K / Q5_K (4-bit
records, Q5_K a fifth bit beside) and Q8_0 / Q6_K (byte records), fp32 activations (FMA) and int8 (VNNI), random weights; ``F32``:
the Q5_K weights dequantized, torch's F.linear (the path Q2_K / Q3_K / Q5_K took before they were
kept quantized).

For each type, one "step" multiplies ``--batch`` rows by every weight of a 1B-class Llama layer
stack (TinyLlama-1.1B's: per layer qkv 2560x2048, o 2048x2048, gate_up 11264x2048, down
2048x5632; ``--layers`` of them), K a multiple of 256 so the K-quants apply. Weights are random
blocks (every bit pattern of a K-quant block is valid; Q4_1 / Q8_0 from the gguf package's
quantizer); the variants are alternated round by round; step ms, median (min) of the steps, and
the packed weight bytes read per step (trillm's layouts: Q4_K 5.5 bits a weight, Q6_K 9, Q5_K
7, Q3_K / Q2_K 6). ``--clock thread``: the calling thread's CPU time (with ``--threads 1`` all the
work is on it; a shared machine's wall time is noise).

    python benchmarks/kernels/quant_gemm_types.py [--batches 1 16] [--layers 2] [--steps 5]
        [--rounds 3] [--threads N] [--types Q4_K F32 ...] [--clock wall|thread] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from trillm.kernels import linear_q_cpu
from trillm.testing.gguf_models import random_kquant_blocks

SHAPES = ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632))  # (N, K) per layer
TYPES = ("Q4_1", "Q4_K", "Q8_0", "Q6_K", "Q3_K", "Q5_K", "Q2_K", "F32")


class Dequantized:
    """A weight dequantized to fp32, multiplied by F.linear (``F32``)."""

    def __init__(self, weight: linear_q_cpu.QuantizedWeight) -> None:
        self.weight = linear_q_cpu.dequantize(weight)
        self.in_features = weight.in_features
        self.nbytes = self.weight.numel() * 4


def make_weight(type_name: str, n: int, k: int, seed: int) -> linear_q_cpu.QuantizedWeight:
    if type_name == "F32":
        return Dequantized(make_weight("Q5_K", n, k, seed))  # type: ignore[return-value]
    kind = GGMLQuantizationType[type_name]
    if type_name.endswith("_K"):
        raw = random_kquant_blocks(type_name, n, k, seed)
    else:
        w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.02
        raw = quants.quantize(w, kind)
    return linear_q_cpu.QuantizedWeight(raw, int(kind), n, k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--types", nargs="+", choices=TYPES, default=list(TYPES))
    p.add_argument("--clock", choices=("wall", "thread"), default="wall")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    assert linear_q_cpu.int8_available(), "needs the native kernel and AVX512-VNNI"
    weights = {
        t: [make_weight(t, n, k, seed=i) for i, (n, k) in enumerate(SHAPES * args.layers)]
        for t in args.types
    }
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        xs = {k: torch.randn(batch, k, generator=gen) for _, k in SHAPES}
        times: dict[tuple[str, bool], list[float]] = {}
        for _ in range(args.rounds):
            for t, ws in weights.items():
                for int8 in (False, True):
                    for step in range(args.steps + 1):  # the first one warms up
                        start = clock()
                        for w in ws:
                            x = xs[w.in_features]
                            if isinstance(w, Dequantized):  # fp32 activations either way
                                torch.nn.functional.linear(x, w.weight)
                            else:
                                linear_q_cpu.linear(x, w, int8_activations=int8)
                        if step:
                            times.setdefault((t, int8), []).append(clock() - start)
        for (t, int8), samples in times.items():
            rows.append(
                dict(
                    type=t,
                    batch=batch,
                    int8=int8,
                    step_ms=statistics.median(samples) * 1e3,
                    min_ms=min(samples) * 1e3,
                    weight_mb=sum(w.nbytes for w in weights[t]) / 1e6,
                )
            )
    print(
        f"{torch.get_num_threads()} threads, {args.layers} layers, {args.rounds} rounds x "
        f"{args.steps} steps; step ms ({args.clock} clock), median (min)"
    )
    print(f"{'type':<5} {'batch':>5} {'weights MB':>10} {'fp32-FMA':>18} {'int8-VNNI':>18}")
    for t in args.types:
        for batch in args.batches:
            fma, vnni = (
                next(r for r in rows if (r["type"], r["batch"], r["int8"]) == (t, batch, i))
                for i in (False, True)
            )
            print(
                f"{t:<5} {batch:>5} {fma['weight_mb']:>10.1f} "
                f"{fma['step_ms']:>9.2f} ({fma['min_ms']:>6.2f}) "
                f"{vnni['step_ms']:>9.2f} ({vnni['min_ms']:>6.2f})"
            )
    if args.out:
        args.out.write_text(
            json.dumps(dict(threads=torch.get_num_threads(), clock=args.clock, rows=rows), indent=2)
        )


if __name__ == "__main__":
    main()
