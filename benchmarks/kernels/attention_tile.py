"""The paged-attention tile kernel (``ext/cpu_attention_tile.h``: items of several query rows)
at the offline benchmark model's shapes (benchmarks/common.py MODEL_SPEC: 8 query / 4 kv heads
of 64, block size 16): one 256-token prompt chunk over 0, 256 and 1024 keys of context, and a
mixed batch (prompt chunks with context beside one-row decode requests). fp32 q and cache (the
offline benchmark's model), ``--dtype bf16`` for a bf16 model. One thread; median thread CPU
time of ``--repeats`` calls (steady on a shared machine: other processes do not count).

Two builds compare by alternating processes, one tree each (query vectors of a kv
head taken in groups against one vector at a time)::

    for r in 1 2; do for tree in /tmp/oldtree /work/wt/attn2; do
        (cd $tree && PYTHONPATH=$tree python benchmarks/kernels/attention_tile.py); done; done
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

# (name, query lengths, context lengths): one request per entry of the two tuples.
CASES = (
    ("chunk256_ctx0", (256,), (0,)),
    ("chunk256_ctx256", (256,), (256,)),
    ("chunk256_ctx1024", (256,), (1024,)),
    ("mixed", (96, 1, 1, 1, 1, 40, 1, 1), (0, 300, 120, 50, 200, 150, 400, 80)),
)


def median_ms(
    qlens: tuple[int, ...], ctx: tuple[int, ...], dtype: torch.dtype, repeats: int
) -> float:
    g = torch.Generator().manual_seed(0)
    seq = [q + c for q, c in zip(qlens, ctx)]
    per_req = [(s + BS - 1) // BS for s in seq]
    blocks = sum(per_req)
    cache = torch.randn(2, blocks, BS, HKV, D, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g).to(torch.int32)  # scattered blocks, like a cache
    table = torch.zeros(len(seq), max(per_req), dtype=torch.int32)
    i = 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[i : i + n]
        i += n
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    q = torch.randn(sum(qlens), HQ, D, generator=g).to(dtype)
    plan = paged_attention_cpu.PagedAttentionPlan(qsl, seq_lens, table, q.shape, cache.shape)
    out = torch.empty_like(q)
    return common.median_thread_ms(lambda: plan.run(q, cache, D**-0.5, out), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    torch.set_num_threads(1)
    cells = [f"{name} {median_ms(q, c, dtype, args.repeats):.3f} ms" for name, q, c in CASES]
    print(f"{os.getcwd()} {args.dtype}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
