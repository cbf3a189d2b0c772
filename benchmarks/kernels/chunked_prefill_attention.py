"""One layer's attention of one long bf16 prompt prefilled in chunks, at Llama-3.2-1B's shape
(32 query / 8 kv heads of 64, block size 16): the first chunk through the fresh-prompt kernel
(``ext/cpu_prefill_attention.cpp``), every later chunk through the paged kernel
(``ext/cpu_attention.cpp``) over the keys already cached, as the engine runs a prompt longer
than ``--max-num-batched-tokens``. Per chunk: wall ms and process CPU ms (medians of
``--repeats``; the threads of ``TRILLM_CPU_ATTENTION_THREADS`` / torch's count: with 1 the CPU
ms is the kernel's own time, far steadier than wall time on a shared machine) and GFLOP/s of
the causal attention math (4 * Hq * D per visible query-key pair). ``--kernels`` runs the
later chunks on each named kernel of ``paged_chunk_kernel``, one after the other, ``--rounds``
times alternated: ``tile`` (the fp32-FMA tile kernel), ``avx2`` (ext/cpu_attention_paged_avx2.h,
the path of CPUs without AVX512-BF16, forced on one that has it), ``bf16-dot`` (vdpbf16ps,
ext/cpu_attention_paged_dp.h: each kv head's key / value tiles packed once per call) and
``bf16-dot-per-item`` (the same with every work item packing its own tiles, as before: the
fresh-prompt chunk too, ``prefill_shared_pack(False)``, while it runs); the ones this CPU lacks
are left out. ``--later-only`` skips the
first (fresh-prompt) chunk: the cache is filled directly.

    TRILLM_CPU_ATTENTION_THREADS=1 python benchmarks/kernels/chunked_prefill_attention.py \
        --prompt-len 8192 --chunk 4096 8192 2048 1024 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from trillm._native import cpu_kernels  # noqa: E402
from trillm.kernels import paged_attention_cpu  # noqa: E402

HQ, HKV, D, BS = 32, 8, 64, 16


def flops(context: int, rows: int) -> float:
    pairs = context * rows + rows * (rows + 1) / 2
    return 4.0 * HQ * D * pairs


def timed_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall ms and median process CPU ms (all threads) of ``repeats`` calls: with
    ``TRILLM_CPU_ATTENTION_THREADS=1`` the CPU ms is the kernel's own time, which a shared
    machine's load stretches far less than the wall time."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def chunks_of(
    total: int, chunk: int, repeats: int, g: torch.Generator, later_only: bool = False
) -> list[dict]:
    blocks = total // BS
    q = torch.randn(total, HQ, D, generator=g).to(torch.bfloat16)
    k = torch.randn(total, HKV, D, generator=g).to(torch.bfloat16)
    v = torch.randn(total, HKV, D, generator=g).to(torch.bfloat16)
    cache = torch.zeros(2, blocks + 1, BS, HKV, D, dtype=torch.bfloat16)
    perm = torch.randperm(blocks, generator=g).to(torch.int32) + 1  # scattered blocks
    slots = (perm.long()[:, None] * BS + torch.arange(BS)).reshape(-1)
    cache[0].view(-1, HKV, D)[slots] = k
    cache[1].view(-1, HKV, D)[slots] = v
    table = perm.view(1, -1)
    rows = []
    out = torch.empty_like(q)
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        if start == 0 and later_only:
            continue
        if start == 0:
            seg = torch.tensor([[0, n]], dtype=torch.int32)
            qc, kc, vc, oc = q[:n], k[:n], v[:n], out[:n]
            call = partial(paged_attention_cpu.causal_prefill, qc, kc, vc, seg, D**-0.5, oc)
            ms, cpu_ms = timed_ms(call, repeats)
            kernel = "fresh"
        else:
            qsl = torch.tensor([0, n], dtype=torch.int32)
            seq = torch.tensor([start + n], dtype=torch.int32)
            qc, oc = q[start : start + n], out[start : start + n]
            plan = paged_attention_cpu.PagedAttentionPlan(qsl, seq, table, qc.shape, cache.shape)
            ms, cpu_ms = timed_ms(partial(plan.run, qc, cache, D**-0.5, oc), repeats)
            kernel = "paged"
        f = flops(start, n)
        rows.append(
            {
                "chunk": chunk,
                "start": start,
                "rows": n,
                "kernel": kernel,
                "ms": round(ms, 1),
                "cpu_ms": round(cpu_ms, 1),
                "gflop": round(f / 1e9, 2),
                "gflops": round(f / ms / 1e6, 1),
                "gflop_per_cpu_s": round(f / cpu_ms / 1e6, 1),
                "load_avg_1m": round(os.getloadavg()[0], 1),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, nargs="+", default=[4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=["tile", "avx2", "bf16-dot", "bf16-dot-per-item"],
        default=["tile", "bf16-dot"],
    )
    parser.add_argument("--rounds", type=int, default=1, help="the kernels alternated, N times")
    parser.add_argument("--later-only", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ext = cpu_kernels("attention")
    before = ext.paged_chunk_kernel()
    kernels = []
    for name in args.kernels:
        try:
            ext.paged_chunk_kernel(name)
            kernels.append(name)
        except RuntimeError:
            print(f"{name}: not on this CPU, left out", flush=True)
    results = []
    try:
        for chunk in args.chunk:
            for r in range(args.rounds):
                for kernel in kernels:
                    ext.paged_chunk_kernel(kernel)
                    ext.prefill_shared_pack(kernel != "bf16-dot-per-item")
                    g = torch.Generator().manual_seed(0)
                    rows = chunks_of(args.prompt_len, chunk, args.repeats, g, args.later_only)
                    total = sum(r["ms"] for r in rows)
                    total_cpu = sum(r["cpu_ms"] for r in rows)
                    gf = sum(r["gflop"] for r in rows)
                    results.append(
                        {
                            "chunk": chunk,
                            "round": r,
                            "paged_kernel": kernel,
                            "chunks": rows,
                            "total_ms": round(total, 1),
                            "total_cpu_ms": round(total_cpu, 1),
                            "gflops": round(gf / total * 1e3, 1),
                            "gflop_per_cpu_s": round(gf / total_cpu * 1e3, 1),
                        }
                    )
                    print(
                        f"chunk {chunk} round {r} paged kernel {kernel}: {total:.0f} ms"
                        f" ({total_cpu:.0f} CPU ms), {gf / total * 1e3:.1f} GFLOP/s,"
                        f" {gf / total_cpu * 1e3:.1f} GFLOP per CPU-s",
                        flush=True,
                    )
    finally:
        ext.paged_chunk_kernel(before)
        ext.prefill_shared_pack(True)
    common.write_json(args.out, {"machine": common.machine_info(), "results": results})


if __name__ == "__main__":
    main()
