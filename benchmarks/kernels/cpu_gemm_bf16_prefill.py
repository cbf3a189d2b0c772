"""The native bf16 GEMM at prefill row counts against the machine's bf16 peak and torch's bf16
``F.linear``, at Llama-3.2-1B's linear shapes (qkv 2048->3072, o 2048->2048, gate_up
2048->16384, down 8192->2048).

The peak is ``bf16_peak.cpp`` (built here with ``c++``): the GEMM's own 6x4-zmm ``vdpbf16ps``
register block on L1-resident data. Each call is timed in wall time and in the process's CPU
time (all threads); on a shared machine the wall rate follows the load, the CPU-time rate
(FLOPs / CPU seconds of all threads: GFLOP a core-second) is what the kernel gets from a core
it holds, pool spin-waits included; against the probe's CPU-time rate (one core's peak) it is
the kernel's efficiency, and times the thread count the wall rate of a quiet machine. The peak probe runs again before every round (its wall rate: the load
meter of that round); native and torch alternate call by call, medians over ``--rounds``.

    python benchmarks/kernels/cpu_gemm_bf16_prefill.py --rows 512 1024 2048 4096 --rounds 3 \
        --out benchmarks/kernels/results/cpu_gemm_bf16_prefill.json

Needs AVX512-BF16 (the native bf16 GEMM's requirement) and a C++ compiler for the probe.
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

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trillm.kernels import linear_cpu  # noqa: E402

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}
PROBE = Path(__file__).with_name("bf16_peak.cpp")


def build_probe(folder: Path) -> Path:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SystemExit("no C++ compiler for bf16_peak.cpp")
    exe = folder / "bf16_peak"
    subprocess.run(
        [compiler, "-O3", "-std=c++17", "-pthread", str(PROBE), "-o", str(exe)], check=True
    )
    return exe


def peak(exe: Path, threads: int, seconds: float) -> dict[str, float]:
    out = subprocess.run([str(exe), str(threads), str(seconds)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bf16_peak failed: {out.stderr.strip()}")
    return dict(json.loads(out.stdout))


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall s, process CPU s) of one call."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--ops", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not linear_cpu.available_bf16():
        raise SystemExit("the native bf16 GEMM needs AVX512-BF16 (and the built extension)")
    threads = torch.get_num_threads()
    result: dict[str, Any] = dict(argv=sys.argv[1:], threads=threads, load_start=os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_probe(Path(tmp))
        result["peak_1_thread"] = peak(exe, 1, 1.0)
        result["peak"] = peak(exe, threads, 1.0)
        print(f"peak: 1 thread {result['peak_1_thread']}, {threads} threads {result['peak']}")
        g = torch.Generator().manual_seed(0)
        weights = {}
        for name in args.ops:
            k, n = SHAPES[name]
            w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
            weights[name] = (w, linear_cpu.PackedWeightBf16(w))
        inputs = {m: torch.randn(m, 8192, generator=g).bfloat16() for m in args.rows}
        samples: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
        meters = []
        for r in range(args.rounds):
            meters.append(peak(exe, threads, 0.3)["wall_gflops"])
            for name in args.ops:
                k, _ = SHAPES[name]
                w, packed = weights[name]
                for m in args.rows:
                    x = inputs[m][:, :k].contiguous()
                    calls = {
                        "native": lambda x=x, p=packed: linear_cpu.linear_bf16(x, p),
                        "torch": lambda x=x, w=w: F.linear(x, w),
                    }
                    for label, fn in calls.items():
                        if r == 0:
                            fn()  # warm-up
                        samples.setdefault((name, m, label), []).append(timed(fn))
        result["load_end"] = os.getloadavg()
        result["peak_wall_per_round"] = meters
    peak_cpu = result["peak"]["cpu_gflops_per_thread"]
    peak_wall = result["peak"]["wall_gflops"]
    rows = []
    print(
        f"{'op':8s} {'M':>5s}  {'native wall':>11s} {'cpu/core':>8s} {'%peak':>5s}"
        f"  {'torch wall':>10s} {'cpu/core':>8s} {'%peak':>5s}   (GFLOP/s; %peak: CPU-time rate"
        f" a core-second / the probe's {peak_cpu:.1f})"
    )
    for name in args.ops:
        k, n = SHAPES[name]
        for m in args.rows:
            flop = 2.0 * m * n * k
            row: dict[str, Any] = dict(op=name, m=m, n=n, k=k)
            for label in ("native", "torch"):
                walls, cpus = zip(*samples[(name, m, label)], strict=True)
                wall_rate = flop / statistics.median(walls) / 1e9
                cpu_rate = flop / statistics.median(cpus) / 1e9  # per CPU-second
                row[f"{label}_wall_gflops"] = round(wall_rate, 1)
                row[f"{label}_cpu_gflops_per_core_s"] = round(cpu_rate, 1)
                row[f"{label}_pct_of_peak_cpu"] = round(100 * cpu_rate / peak_cpu, 1)
                row[f"{label}_pct_of_peak_wall"] = round(100 * wall_rate / peak_wall, 1)
            rows.append(row)
            print(
                f"{name:8s} {m:5d}  {row['native_wall_gflops']:11.1f}"
                f" {row['native_cpu_gflops_per_core_s']:8.1f} {row['native_pct_of_peak_cpu']:5.1f}"
                f"  {row['torch_wall_gflops']:10.1f} {row['torch_cpu_gflops_per_core_s']:8.1f}"
                f" {row['torch_pct_of_peak_cpu']:5.1f}",
                flush=True,
            )
    result["shapes"] = rows
    print(f"load {result['load_start']} -> {result['load_end']}; probe wall per round {meters}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
