"""The int8-activation GEMM with per-32 activation scales (a previous build of the kernel)
against per-16 (this build), one process, alternated round by round, on a GGUF's projections.

``--old-ext`` names the previous build's ``cpu_kernels`` shared object (the packed weight
layout is the same); both run the 120 GEMMs of a SmolLM2 step (``q4_int8.load_weights``) at
each batch, ``--steps`` steps a round; step ms, median (min); one thread.

    python benchmarks/kernels/int8_act_scales.py --gguf Q8_0.gguf --old-ext OLD/cpu_kernels.so \\
        --batches 16 64 --steps 5 --rounds 4 [--out x.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from benchmarks.kernels.q4_int8 import load_weights
from trillm.kernels import linear_q_cpu


def load_old(path: Path):  # the previous build, under its own module name's init symbol
    spec = importlib.util.spec_from_file_location("cpu_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gemm_q


def run(ext, weights, x: dict[int, torch.Tensor]) -> None:
    for w in weights:
        parts = w.parts if isinstance(w, linear_q_cpu.StackedQuantizedWeight) else [w]
        xs = x[w.in_features]
        out = torch.empty(xs.shape[0], w.out_features)
        col = 0
        for p in parts:
            ext.linear(
                xs.data_ptr(),
                False,
                xs.shape[0],
                w.in_features,
                xs.stride(0),
                p.data.data_ptr(),
                p.kernel_type,
                p.out_features,
                0,
                out.data_ptr() + 4 * col,
                False,
                w.out_features,
                1,
                True,
            )
            col += p.out_features


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, nargs="+", required=True)
    p.add_argument("--old-ext", type=Path, required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    new = linear_q_cpu._ext()
    old = load_old(args.old_ext)
    rows = []
    for path in args.gguf:
        weights = load_weights(path)
        for batch in args.batches:
            gen = torch.Generator().manual_seed(batch)
            x = {k: torch.randn(batch, k, generator=gen) for k in {w.in_features for w in weights}}
            times: dict[str, list[float]] = {"per-32": [], "per-16": []}
            for _ in range(args.rounds):
                for name, ext in (("per-32", old), ("per-16", new)):
                    run(ext, weights, x)  # warm
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        run(ext, weights, x)
                        times[name].append((time.perf_counter() - start) * 1e3)
            row = dict(gguf=path.name, batch=batch)
            for name, t in times.items():
                row[name] = (statistics.median(t), min(t))
            row["cost"] = row["per-16"][0] / row["per-32"][0] - 1
            row["cost_min"] = row["per-16"][1] / row["per-32"][1] - 1
            rows.append(row)
            print(
                f"{path.name} batch {batch}: per-32 {row['per-32'][0]:.1f} ({row['per-32'][1]:.1f}) "
                f"ms, per-16 {row['per-16'][0]:.1f} ({row['per-16'][1]:.1f}) ms, "
                f"{row['cost']:+.1%} ({row['cost_min']:+.1%})",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
