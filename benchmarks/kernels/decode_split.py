"""Batch-1 decode attention split by key range over the threads (flash-decoding,
ext/cpu_attention.cpp's plan_key_splits) against whole (request, kv head) items: one decode
step's attention at SmolLM2-135M's shape (9 query / 3 kv heads of 64, 30 layers, block size 16,
fp32 cache as the Q4_1 GGUF serves it; ``--cache`` for others), batch 1 after BATCHxKEYS cached
keys, on ``--threads`` threads (wall time: the split is about idle threads). Plans with and
without parts are made in turn (``paged_decode_key_splits``) and timed alternately, ``--rounds``
rounds of ``--repeats`` steps each; the medians of the rounds' medians.

    python benchmarks/kernels/decode_split.py [--threads 2] [--cases 1x256 1x1024 1x4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks.kernels.decode_attention import CACHES, make_step
from trillm._ext import cpu_kernels


def _median_ms(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=["1x256", "1x384", "1x1024", "1x4096"])
    p.add_argument("--cache", choices=sorted(CACHES), default="fp32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    os.environ["TRILLM_CPU_ATTENTION_THREADS"] = str(args.threads)  # (decode_attention sets 1)
    ext = cpu_kernels.attention
    before = ext.paged_decode_key_splits()
    print(
        f"SmolLM2 shape (9/3 heads of 64), {args.layers} layers, {args.cache} cache, fp32 q, "
        f"{args.threads} threads, wall ms a step (median of {args.rounds} rounds' medians of "
        f"{args.repeats})"
    )
    print(f"{'case':>8} {'whole items':>12} {'key parts':>10} {'ratio':>6}")
    try:
        for case in args.cases:
            batch, keys = (int(x) for x in case.split("x"))
            steps = {}
            for on in (False, True):
                ext.paged_decode_key_splits(int(on))
                steps[on] = make_step(
                    batch, keys, args.layers, (9, 3), torch.float32, CACHES[args.cache]
                )[0]
            ms: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.rounds):
                for on in (False, True) if r % 2 == 0 else (True, False):
                    ms[on].append(_median_ms(steps[on], args.repeats))
            old, new = (statistics.median(ms[on]) for on in (False, True))
            print(f"{case:>8} {old:>12.3f} {new:>10.3f} {new / old:>6.2f}")
    finally:
        ext.paged_decode_key_splits(int(before))


if __name__ == "__main__":
    main()
