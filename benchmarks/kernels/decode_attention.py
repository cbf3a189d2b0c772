"""The paged-attention decode kernel (``ext/cpu_attention_decode.h``: one query row per request)
against the memory it reads: per layer, the kernel's time for a batch of decode rows over their
cached keys and the bytes of K / V it reads per second, beside a plain sequential read (``sum``)
of as many bytes, all on one thread (median thread CPU time). The offline benchmark model's
shapes (benchmarks/common.py MODEL_SPEC: 8 query / 4 kv heads of 64, block size 16), fp32 cache,
blocks scattered as in a cache that has served a while; ``--layers`` caches are walked in turn so
that a batch's K / V comes from memory, not from the last layer's cache lines.

    python benchmarks/kernels/decode_attention.py [--layers 8] [--repeats 9]

``--shape 1b``: Llama-3.2-1B's attention instead (32 query / 8 kv heads of 64, bf16 q and
cache, 16 layers by default; batch 1 and 16 over 512 / 1,024 / 4,096 keys), each case timed
on both bf16 decode kernels, alternated in one process (``one-row``: ext/cpu_attention_decode.h,
``bf16-dot``: ext/cpu_attention_decode_dp.h, where the CPU has AVX512-BF16).
``--shape smollm2``: SmolLM2-135M's (9 query / 3 kv heads of 64, bf16, 30 layers by default;
batch 16 over 256 / 320 / 384 keys: a concurrency-16 run of 256-token prompts and 128 outputs,
at its start, middle and end; and batch 1 over 320), both kernels alike. ``--shape qwen3``:
Qwen3-1.7B's (16 query / 8 kv heads of 128, bf16, 28 layers; batch 1 and 16 over 300 / 1,024 /
4,096 keys).
With either shape, ``--cache fp8`` / ``fp32`` times that cache instead of bf16, ``--q fp32``
fp32 queries instead of bf16 (a float32 model over a ``--kv-cache-dtype bfloat16`` cache:
``bf16-dot`` takes bf16 queries only, so fp32 ones run ``avx2`` under it), ``--cases
1x1024 16x1024`` (batch x keys) picks cases, ``--kernels`` the decode kernels (default: every
one the CPU has; ``avx2``: ext/cpu_attention_decode.h widening each key / value row once for a
block of the GQA group, AVX2 + FMA, bf16 / fp8 caches; under ``bf16-dot`` fp8 caches run
``avx2``, and fp32 caches run ``one-row`` under either; ``bf16-dot-per-head``: the vdpbf16ps
kernel walking the keys once per kv head, as before ext/cpu_attention_decode_dp_slots.h, the
same bits).

    python benchmarks/kernels/decode_attention.py --shape 1b --repeats 7 --cache fp8 \
        --cases 1x1024 16x1024 --kernels one-row avx2
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
CASES_1B = ((1, 512), (1, 1024), (1, 4096), (16, 512), (16, 1024), (16, 4096))
CASES_SMOLLM2 = ((16, 256), (16, 320), (16, 384), (1, 320))
CASES_QWEN3 = ((1, 300), (1, 1024), (1, 4096), (16, 300), (16, 1024), (16, 4096))
# --shape: (query heads, kv heads, head_dim), cases, default layers
SHAPES = {
    "1b": ((32, 8, 64), CASES_1B, 16),
    "smollm2": ((9, 3, 64), CASES_SMOLLM2, 30),
    "qwen3": ((16, 8, 128), CASES_QWEN3, 28),
}


def make_step(
    batch: int,
    ctx: int,
    layers: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    head_dim: int = D,
):
    """(one decode step's attention over `layers` caches, K / V bytes a layer reads)."""
    cache_dtype = cache_dtype or dtype
    hq, hkv = heads
    D = head_dim
    g = torch.Generator().manual_seed(batch + ctx)
    seq = [ctx + 1] * batch
    per_req = (ctx + 1 + BS - 1) // BS
    blocks = batch * per_req
    caches = [
        torch.randn(2, blocks, BS, hkv, D, generator=g).to(cache_dtype) for _ in range(layers)
    ]
    table = torch.randperm(blocks, generator=g).to(torch.int32).view(batch, per_req)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    q = torch.randn(batch, hq, D, generator=g).to(dtype)
    plan = paged_attention_cpu.PagedAttentionPlan(qsl, seq_lens, table, q.shape, caches[0].shape)
    out = torch.empty_like(q)

    def step() -> None:
        for cache in caches:
            plan.run(q, cache, D**-0.5, out)

    return step, batch * (ctx + 1) * hkv * D * cache_dtype.itemsize * 2


def kernel_ms(batch: int, ctx: int, layers: int, repeats: int) -> tuple[float, int]:
    """Median ms per layer, K / V bytes a layer reads."""
    step, nbytes = make_step(batch, ctx, layers, (HQ, HKV), torch.float32)
    return common.median_thread_ms(step, repeats) / layers, nbytes


CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}


def compare_bf16(
    shape: str, layers: int, repeats: int, cache="bf16", kernels=None, cases=None, q="bf16"
) -> None:
    """The decode kernels (bf16 q, or ``q``) at a model's shape (SHAPES), alternated call by
    call."""
    import statistics
    import time

    from trillm._ext import cpu_kernels

    ext = cpu_kernels.attention
    before = ext.paged_decode_kernel()
    names = []
    for name in kernels or ["one-row", "avx2", "bf16-dot-per-head", "bf16-dot"]:
        try:
            ext.paged_decode_kernel(name)
            names.append(name)
        except RuntimeError:
            print(f"(this CPU has no {name!r} decode kernel)")
    print(f"{q} q, {cache} cache")
    print("batch  keys  kernel             ms/step (thread CPU, all layers)  K/V GB/s")
    (hq, hkv, head_dim), shape_cases, _ = SHAPES[shape]
    for batch, ctx in cases or shape_cases:
        step, nbytes = make_step(batch, ctx, layers, (hq, hkv), CACHES[q], CACHES[cache], head_dim)
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(repeats):
            for name in names:
                ext.paged_decode_kernel(name)
                start = time.thread_time()
                step()
                times[name].append(time.thread_time() - start)
        for name in names:
            ms = statistics.median(times[name]) * 1e3
            gbps = nbytes * layers / ms / 1e6
            print(f"{batch:5d} {ctx:5d}  {name:17s} {ms:10.2f} {gbps:24.1f}")
    ext.paged_decode_kernel(before)


def read_gbps(nbytes: int, repeats: int) -> float:
    x = torch.randn(nbytes // 4)
    return nbytes / common.median_thread_ms(lambda: x.sum(), repeats) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers", type=int, default=None, help="default: 8; 16 for 1b, 30 smollm2, 28 qwen3"
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--shape", choices=["small", *SHAPES], default="small")
    parser.add_argument("--cache", choices=sorted(CACHES), default="bf16", help="1b, smollm2")
    parser.add_argument("--kernels", nargs="+", help="1b, smollm2: default every one the CPU has")
    parser.add_argument("--cases", nargs="+", help="1b, smollm2: BATCHxKEYS, e.g. 1x1024")
    parser.add_argument("--q", choices=["bf16", "fp32"], default="bf16", help="1b, smollm2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.shape in SHAPES:
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases or []]
        layers = args.layers or SHAPES[args.shape][2]
        compare_bf16(args.shape, layers, args.repeats, args.cache, args.kernels, cases, args.q)
        return
    args.layers = args.layers or 8
    print("batch  keys  ms/layer  kernel GB/s  plain read GB/s (same bytes x layers)")
    for batch, ctx in CASES:
        ms, nbytes = kernel_ms(batch, ctx, args.layers, args.repeats)
        plain = read_gbps(nbytes * args.layers, args.repeats)
        print(f"{batch:5d} {ctx:5d} {ms:9.3f} {nbytes / ms / 1e6:12.1f} {plain:16.1f}")


if __name__ == "__main__":
    main()
