"""GFLOP/s at Llama-3.2-1B's linear shapes (fused as trillm runs them): torch's bf16 and fp32
``F.linear``, trillm's packed fp32 GEMM and the AVX2 bf16 GEMM (``linear_bf16_avx2_cpu``), best
of a few calls, the load average recorded (a shared machine: compare within one run only).

    python benchmarks/kernels/cpu_gemm_bf16_avx2.py 1024 16 > results/cpu_gemm_bf16_avx2.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trillm.kernels import linear_bf16_avx2_cpu, linear_cpu  # noqa: E402

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}


def best_s(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def rates(rows: int, k: int, n: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    xb, wb = x.bfloat16(), w.bfloat16()
    packed_bf16 = linear_bf16_avx2_cpu.PackedWeightBf16Avx2(wb)
    packed_fp32 = linear_cpu.PackedWeight(w)
    gflop = 2 * rows * k * n / 1e9
    reps = 1 if rows >= 256 else 5
    calls = {
        "torch_bf16": lambda: F.linear(xb, wb),
        "torch_fp32": lambda: F.linear(x, w),
        "trillm_fp32_packed": lambda: linear_cpu.linear(x, packed_fp32),
        "trillm_bf16_avx2": lambda: linear_bf16_avx2_cpu.linear_bf16(xb, packed_bf16),
    }
    return {name: round(gflop / best_s(call, reps), 1) for name, call in calls.items()}


def main() -> None:
    out: dict[str, Any] = {"load_start": os.getloadavg(), "threads": torch.get_num_threads()}
    for rows in [int(r) for r in sys.argv[1:]] or [1024]:
        for name, (k, n) in SHAPES.items():
            out[f"{name}_rows{rows}"] = rates(rows, k, n)
    out["load_end"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
