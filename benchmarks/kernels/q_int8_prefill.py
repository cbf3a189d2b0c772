"""The quantized GEMM with int8 activations (VNNI) at prefill row counts against the machine's
int8 peak and the native bf16 GEMM, at Llama-3.2-1B's linear shapes (qkv 2048->3072, o
2048->2048, gate_up 2048->16384, down 8192->2048), for Q8_0 and Q4_0 weights.

The peaks are ``int8_peak.cpp`` (``vpdpbusd`` in a 6x4-zmm register block on L1-resident data;
also with the fp32 step every 16 k that trillm's per-16 activation scales need: the ceiling of
such a kernel; and with the prefill kernel's own fp32 step, whose order of roundings its results
keep: 344 GOP/s a core on this host for Q4_0 / Q8_0, 310 for the types with a minimum) and
``bf16_peak.cpp``, built here with ``c++``. Each call is timed in wall time
and in the process's CPU time (all threads): on a shared machine the wall rate follows the
load, the CPU-time rate (ops / CPU seconds of all threads: GOP a core-second) is what the
kernel gets from a core it holds. One op is a multiply or an add (2 a product), as GFLOP/s
counts them for the bf16 GEMM. The int8 call includes rounding x to int8 (bf16 x, as a bf16
model's layers pass it). Types and the bf16 GEMM alternate call by call; medians over
``--rounds``. Weights: random GGML blocks (scales 0.01); the rates do not depend on values.

    python benchmarks/kernels/q_int8_prefill.py --rows 512 1024 2048 4096 --rounds 3 \
        --out benchmarks/kernels/results/q_int8_prefill.json

Needs AVX512-VNNI and AVX512-BF16 and a C++ compiler for the probes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trillm.kernels import linear_cpu, linear_q_cpu  # noqa: E402

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}
TYPES = {"Q8_0": (linear_q_cpu.Q8_0, 34), "Q4_0": (linear_q_cpu.Q4_0, 18)}
HERE = Path(__file__).parent


def build(folder: Path, name: str) -> Path:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SystemExit(f"no C++ compiler for {name}.cpp")
    exe = folder / name
    src = str(HERE / f"{name}.cpp")
    subprocess.run([compiler, "-O3", "-std=c++17", "-pthread", src, "-o", str(exe)], check=True)
    return exe


def probe(exe: Path, *args: object) -> dict[str, float]:
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{exe.name} failed: {out.stderr.strip()}")
    return dict(json.loads(out.stdout))


def random_weight(qtype: int, block_bytes: int, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, block_bytes), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return linear_q_cpu.QuantizedWeight(raw.reshape(n, -1), qtype, n, k)


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall s, process CPU s) of one call."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--ops", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (linear_q_cpu.int8_available() and linear_cpu.available_bf16()):
        raise SystemExit("needs AVX512-VNNI and AVX512-BF16 (and the built extension)")
    threads = torch.get_num_threads()
    result: dict[str, Any] = dict(argv=sys.argv[1:], threads=threads, load_start=os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        int8_exe, bf16_exe = build(Path(tmp), "int8_peak"), build(Path(tmp), "bf16_peak")
        result["int8_peak_1_thread"] = probe(int8_exe, 1, 1.0)
        result["int8_peak_scaled_1_thread"] = probe(int8_exe, 1, 1.0, 1)
        result["int8_peak_exact_1_thread"] = probe(int8_exe, 1, 1.0, 2)
        result["int8_peak_exact_minimum_1_thread"] = probe(int8_exe, 1, 1.0, 3)
        result["bf16_peak_1_thread"] = probe(bf16_exe, 1, 1.0)
        print(
            f"peaks a core: int8 {result['int8_peak_1_thread']}, int8 with per-16 scales "
            f"{result['int8_peak_scaled_1_thread']}, the prefill kernel's exact fp32 step "
            f"{result['int8_peak_exact_1_thread']} (with a minimum "
            f"{result['int8_peak_exact_minimum_1_thread']}), bf16 {result['bf16_peak_1_thread']}"
        )
        g = torch.Generator().manual_seed(0)
        weights: dict[str, dict[str, Any]] = {}
        for i, name in enumerate(args.ops):
            k, n = SHAPES[name]
            w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
            weights[name] = {"bf16": linear_cpu.PackedWeightBf16(w)}
            for t in args.types:
                weights[name][t] = random_weight(*TYPES[t], n, k, seed=i)
        inputs = {m: torch.randn(m, 8192, generator=g).bfloat16() for m in args.rows}
        samples: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for name in args.ops:
                k, _ = SHAPES[name]
                for m in args.rows:
                    x = inputs[m][:, :k].contiguous()
                    calls: dict[str, Callable[[], Any]] = {
                        "bf16": lambda x=x, p=weights[name]["bf16"]: linear_cpu.linear_bf16(x, p)
                    }
                    for t in args.types:
                        calls[t] = lambda x=x, w=weights[name][t]: linear_q_cpu.linear(
                            x, w, int8_activations=True
                        )
                    for label, fn in calls.items():
                        if r == 0:
                            fn()  # warm-up
                        samples.setdefault((name, m, label), []).append(timed(fn))
        result["load_end"] = os.getloadavg()
    peak = result["int8_peak_1_thread"]["cpu_gops_per_thread"]
    labels = [*args.types, "bf16"]
    rows = []
    print(f"GOP/s a core-second (CPU time), % of the int8 peak {peak:.1f}; wall GOP/s in ()")
    print(f"{'op':8s} {'M':>5s}  " + "  ".join(f"{lb:>20s}" for lb in labels))
    for name in args.ops:
        k, n = SHAPES[name]
        for m in args.rows:
            ops = 2.0 * m * n * k
            row: dict[str, Any] = dict(op=name, m=m, n=n, k=k)
            cells = []
            for label in labels:
                walls, cpus = zip(*samples[(name, m, label)], strict=True)
                wall_rate = ops / statistics.median(walls) / 1e9
                cpu_rate = ops / statistics.median(cpus) / 1e9
                row[f"{label}_wall_gops"] = round(wall_rate, 1)
                row[f"{label}_cpu_gops_per_core_s"] = round(cpu_rate, 1)
                row[f"{label}_pct_of_int8_peak"] = round(100 * cpu_rate / peak, 1)
                cells.append(f"{cpu_rate:6.1f} {100 * cpu_rate / peak:4.0f}% ({wall_rate:5.1f})")
            rows.append(row)
            print(f"{name:8s} {m:5d}  " + "  ".join(f"{c:>20s}" for c in cells), flush=True)
    result["shapes"] = rows
    print(f"threads {threads}; load {result['load_start']} -> {result['load_end']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
