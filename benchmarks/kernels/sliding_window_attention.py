"""CPU decode attention with and without a sliding window (ext/cpu_attention.cpp): a windowed
layer reads and scores only its window's keys, so its time should follow the window, not the
context. Best of ``--repeat`` runs of one layer's decode step (the same cache each run, so a
small window's keys stay in cache between runs: the figures are upper bounds for a model,
where every layer has its own cache).

    python benchmarks/kernels/sliding_window_attention.py [--out benchmarks/kernels/results/sliding_window.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from trillm.kernels import paged_attention_cpu


def _problem(batch: int, context: int, heads=8, kv_heads=2, head_dim=64, block=16):
    g = torch.Generator().manual_seed(0)
    blocks = -(-context // block)
    kv = torch.randn(2, batch * blocks, block, kv_heads, head_dim, generator=g)
    table = torch.randperm(batch * blocks, generator=g).to(torch.int32).view(batch, blocks)
    q = torch.randn(batch, heads, head_dim, generator=g)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    return q, kv, qsl, seq_lens, table


def _time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    q, kv, qsl, seq_lens, table = _problem(args.batch, args.context)
    plan = paged_attention_cpu.PagedAttentionPlan(qsl, seq_lens, table, q.shape, kv.shape)
    rows = []
    for window in (None, 2048, 512, 128):
        native = _time(lambda w=window: plan.run(q, kv, 0.125, None, w), args.repeat)
        rows.append({"window": window, "native_ms": round(native, 3)})
        print(f"window {window}: native {native:.3f} ms")
    result = {
        "batch": args.batch,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
