"""One decode row through every quantized weight of Llama-3.2-1B's shape: the batch-1 GEMVs alone.

Random blocks (any bit pattern of a Q4_0 / Q8_0 block is valid; d set so the values are O(1))
in the 1B's 16 layers (qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192), and
with ``--head`` its tied 128,256 x 2048 head in Q6_K, as llama-quantize stores it beside Q4_0.
One bf16 row (``--x-dtype``) goes through them in model order, ``--passes`` times per round,
``--rounds`` rounds; median ms per pass and the packed bytes read over it (GB/s). ``--clock
thread``: one thread, its CPU time (on a shared machine wall time is noise). Run it under two
builds (``PYTHONPATH=<tree>``) to compare kernels.

    python benchmarks/kernels/q_gemv_1b.py [--types Q4_0 Q8_0] [--head] [--layers 16]
        [--x-dtype bfloat16|float32] [--clock wall|thread] [--rounds 3] [--passes 3] [--out x.json]
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

from trillm.kernels import linear_q_cpu
from trillm.testing.gguf_models import random_kquant_blocks

SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # (N, K) per layer
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}
TYPE_IDS = {"Q4_0": linear_q_cpu.Q4_0, "Q8_0": linear_q_cpu.Q8_0, "Q6_K": linear_q_cpu.Q6_K}


def random_weight(type_name: str, n: int, k: int, rng: np.random.Generator):
    if type_name == "Q6_K":
        raw = random_kquant_blocks(type_name, n, k, int(rng.integers(1 << 30)))
    else:
        blocks = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[type_name]), dtype=np.uint8)
        d = np.full((n, k // 32), 0.01 if type_name == "Q8_0" else 0.1, np.float16)
        blocks[:, :, 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
        raw = blocks.reshape(n, -1)
    return linear_q_cpu.QuantizedWeight(raw, TYPE_IDS[type_name], n, k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"])
    p.add_argument("--head", action="store_true")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--x-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--clock", choices=["wall", "thread"], default="wall")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    clock = time.perf_counter
    if args.clock == "thread":
        torch.set_num_threads(1)
        clock = time.thread_time
    rng = np.random.default_rng(0)
    dtype = getattr(torch, args.x_dtype)
    stacks = {}
    for t in args.types:
        stacks[t] = [random_weight(t, n, k, rng) for _ in range(args.layers) for n, k in SHAPES]
    if args.head:
        stacks["Q6_K head"] = [random_weight("Q6_K", 128256, 2048, rng)]
    rows = {k: torch.randn(1, k).to(dtype) for k in (2048, 8192)}
    times: dict[str, list[float]] = {name: [] for name in stacks}
    for _ in range(args.rounds):
        for name, weights in stacks.items():  # alternated round by round
            for w in weights:  # warm: first touch
                linear_q_cpu.linear(rows[w.in_features], w)
            for _ in range(args.passes):
                start = clock()
                for w in weights:
                    linear_q_cpu.linear(rows[w.in_features], w)
                times[name].append(clock() - start)
    result = []
    for name, t in times.items():
        nbytes = sum(w.nbytes for w in stacks[name])
        ms = statistics.median(t) * 1e3
        result.append(
            dict(weights=name, ms=ms, min_ms=min(t) * 1e3, mb=nbytes / 1e6, gbps=nbytes / ms / 1e6)
        )
    print(
        f"{torch.get_num_threads()} threads, {args.clock} clock, x {args.x_dtype}, {args.layers} layers"
    )
    for r in result:
        print(
            f"{r['weights']:<10} {r['mb']:8.1f} MB {r['ms']:8.2f} ms (min {r['min_ms']:.2f}) {r['gbps']:6.1f} GB/s"
        )
    if args.out:
        args.out.write_text(
            json.dumps(dict(clock=args.clock, x_dtype=args.x_dtype, rows=result), indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
