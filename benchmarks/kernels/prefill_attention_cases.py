"""The prefill attention kernels case by case, one thread: the fresh-prompt kernel
(``ext/cpu_prefill_attention.cpp``) at SmolLM2-135M's shape (8 x 256-token prompts, 9 query /
3 kv heads of 64) and Llama-3.2-1B's (one 2,048-token prompt, 32 / 8 of 64), and the paged
kernel's later chunk at the 1B's shape (``ext/cpu_attention.cpp``: 2,048 new queries over 2,048 /
4,096 / 6,144 cached keys, scattered blocks of 16). Per case and dtype (bf16 q over a bf16 cache;
float32, the path of a GGUF run in float32): median thread CPU ms of ``--repeats`` calls and
GFLOP a core-second of the causal attention math (4 * Hq * D per visible query-key pair, each
counted once). Two builds compare by alternating processes, one tree each::

    for t in OLD NEW OLD NEW; do (cd $t && python benchmarks/kernels/prefill_attention_cases.py); done
"""

from __future__ import annotations

import argparse
import os

os.environ["TRILLM_CPU_ATTENTION_THREADS"] = "1"

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch  # noqa: E402

from benchmarks import common  # noqa: E402 (benchmarks/common.py)
from trillm.kernels import paged_attention_cpu  # noqa: E402

CASES = {  # name -> (kind, segments or cached keys, rows, Hq, Hkv, D)
    "fresh-smollm2-8x256": ("fresh", 8, 256, 9, 3, 64),
    "fresh-1b-2048": ("fresh", 1, 2048, 32, 8, 64),
    "paged-1b-2048-over-2048": ("paged", 2048, 2048, 32, 8, 64),
    "paged-1b-2048-over-4096": ("paged", 4096, 2048, 32, 8, 64),
    "paged-1b-2048-over-6144": ("paged", 6144, 2048, 32, 8, 64),
}


def run_case(name: str, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """-> (median thread CPU ms, GFLOP a core-second)."""
    kind, a, rows, hq, hkv, d = CASES[name]
    g = torch.Generator().manual_seed(0)
    if kind == "fresh":
        t = a * rows
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        k, v = (torch.randn(t, hkv, d, generator=g).to(dtype) for _ in range(2))
        segments = torch.tensor([(i * rows, rows) for i in range(a)], dtype=torch.int32)
        out = torch.empty_like(q)
        ms = common.median_thread_ms(
            lambda: paged_attention_cpu.causal_prefill(q, k, v, segments, d**-0.5, out), repeats
        )
        pairs = a * rows * (rows + 1) / 2
    else:
        bs, total = 16, a + rows
        q = torch.randn(rows, hq, d, generator=g).to(dtype)
        cache = torch.randn(2, total // bs + 1, bs, hkv, d, generator=g).to(dtype)
        table = (torch.randperm(total // bs, generator=g) + 1).to(torch.int32).view(1, -1)
        qsl = torch.tensor([0, rows], dtype=torch.int32)
        seq = torch.tensor([total], dtype=torch.int32)
        plan = paged_attention_cpu.PagedAttentionPlan(qsl, seq, table, q.shape, cache.shape)
        out = torch.empty_like(q)
        ms = common.median_thread_ms(lambda: plan.run(q, cache, d**-0.5, out), repeats)
        pairs = a * rows + rows * (rows + 1) / 2
    return ms, 4.0 * hq * d * pairs / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument(
        "--dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for dt in args.dtypes:
        for name in args.cases:
            ms, rate = run_case(name, getattr(torch, dt), args.repeats)
            print(f"{dt:9s} {name:26s} {ms:9.1f} ms {rate:7.1f} GFLOP a core-s", flush=True)


if __name__ == "__main__":
    main()
