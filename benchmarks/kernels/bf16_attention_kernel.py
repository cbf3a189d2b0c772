"""One layer's bf16 paged attention (``ext/cpu_attention.cpp``) at the real model's shapes
(SmolLM2-135M: 9 query / 3 kv heads of 64, block size 16): 16 fresh 256-token prompts, and a
decode step of 16 rows over 256 keys; and the 16 prompts through the fresh-prompt kernel
(``ext/cpu_prefill_attention.cpp``) where it takes bf16. One thread; median thread CPU time of ``--repeats`` calls
(steadier than wall time on a shared machine).

Two builds compare by alternating processes, one tree each (the two-pass bf16 path
against the online softmax it replaced)::

    for r in 1 2 3 4; do for tree in /tmp/oldtree /work/wt/bf16p; do
        (cd $tree && PYTHONPATH=$tree python benchmarks/kernels/bf16_attention_kernel.py); done; done
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

BS, HQ, HKV, D, N, L = 16, 9, 3, 64, 16, 256


def median_ms(query_len: int, repeats: int, g: torch.Generator) -> float:
    blocks = N * L // BS
    cache = torch.randn(2, blocks, BS, HKV, D, generator=g).to(torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32).view(N, L // BS)
    qsl = torch.arange(0, N * query_len + 1, query_len, dtype=torch.int32)
    seq_lens = torch.full((N,), L, dtype=torch.int32)
    q = torch.randn(N * query_len, HQ, D, generator=g).to(torch.bfloat16)  # [T, Hq, D]
    plan = paged_attention_cpu.PagedAttentionPlan(qsl, seq_lens, table, q.shape, cache.shape)
    out = torch.empty_like(q)
    return common.median_thread_ms(lambda: plan.run(q, cache, D**-0.5, out), repeats)


def prefill_kernel_ms(repeats: int, g: torch.Generator) -> float | None:
    """The same 16 fresh prompts through the fresh-prompt kernel (None where it has no bf16)."""
    if not hasattr(paged_attention_cpu, "prefill_supports_layout"):
        return None
    q = torch.randn(N * L, HQ, D, generator=g).to(torch.bfloat16)  # [T, Hq, D]
    k, v = (torch.randn(N * L, HKV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    segments = torch.tensor([(i * L, L) for i in range(N)], dtype=torch.int32)
    out = torch.empty_like(q)
    run = lambda: paged_attention_cpu.causal_prefill(q, k, v, segments, D**-0.5, out)  # noqa: E731
    return common.median_thread_ms(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prefill = median_ms(L, args.repeats, g)
    decode = median_ms(1, args.repeats, g)
    fresh = prefill_kernel_ms(args.repeats, g)
    print(
        f"prefill 16 x 256: {prefill:.1f} ms   decode 16 rows x 256 keys: {decode:.3f} ms"
        + ("" if fresh is None else f"   fresh-prompt kernel 16 x 256: {fresh:.1f} ms")
    )


if __name__ == "__main__":
    main()
