"""The paged-attention decode kernel (``ext/cpu_attention_decode.h``: one query row per request)
against the memory it reads: per layer, the kernel's time for a batch of decode rows over their
cached keys and the bytes of K / V it reads per second, beside a plain sequential read (``sum``)
of as many bytes, all on one thread (median thread CPU time). The offline benchmark model's
shapes (benchmarks/common.py MODEL_SPEC: 8 query / 4 kv heads of 64, block size 16), fp32 cache,
blocks scattered as in a cache that has served a while; ``--layers`` caches are walked in turn so
that a batch's K / V comes from memory, not from the last layer's cache lines.

    python benchmarks/kernels/decode_attention.py [--layers 8] [--repeats 9]
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

BS, HQ, HKV, D = 16, 8, 4, 64
CASES = ((64, 64), (64, 256), (16, 256), (1, 512))  # (decode rows, cached keys each)


def kernel_ms(batch: int, ctx: int, layers: int, repeats: int) -> tuple[float, int]:
    """Median ms per layer, K / V bytes a layer reads."""
    g = torch.Generator().manual_seed(batch + ctx)
    seq = [ctx + 1] * batch
    per_req = (ctx + 1 + BS - 1) // BS
    blocks = batch * per_req
    caches = [torch.randn(2, blocks, BS, HKV, D, generator=g) for _ in range(layers)]
    table = torch.randperm(blocks, generator=g).to(torch.int32).view(batch, per_req)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, generator=g)
    plan = paged_attention_cpu.PagedAttentionPlan(qsl, seq_lens, table, q.shape, caches[0].shape)
    out = torch.empty_like(q)

    def step() -> None:
        for cache in caches:
            plan.run(q, cache, D**-0.5, out)

    ms = common.median_thread_ms(step, repeats) / layers
    return ms, batch * (ctx + 1) * HKV * D * 4 * 2


def read_gbps(nbytes: int, repeats: int) -> float:
    x = torch.randn(nbytes // 4)
    return nbytes / common.median_thread_ms(lambda: x.sum(), repeats) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("batch  keys  ms/layer  kernel GB/s  plain read GB/s (same bytes x layers)")
    for batch, ctx in CASES:
        ms, nbytes = kernel_ms(batch, ctx, args.layers, args.repeats)
        plain = read_gbps(nbytes * args.layers, args.repeats)
        print(f"{batch:5d} {ctx:5d} {ms:9.3f} {nbytes / ms / 1e6:12.1f} {plain:16.1f}")


if __name__ == "__main__":
    main()
