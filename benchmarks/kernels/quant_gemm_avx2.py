"""The quantized GEMM's AVX2 kernel against what an AVX2-only CPU ran before it: one weight of
Llama-3.2-1B's shapes (``2048x8192``: down, N 2048 x K 8192; ``8192x2048``: gate / up, N 8192 x
K 2048) in Q8_0 and Q4_0, ``--rows`` rows of fp32 activations, per call:

- ``avx2``: ``linear_q_cpu.linear`` with the AVX2 kernel (``use_isa("avx2")``);
- ``dequant``: the fallback it replaces, ``F.linear(x, dequantize(W))`` each call;
- ``f32``: torch's ``F.linear`` on the weight dequantized once (4 bytes a value).

Random weights (the gguf package's quantizer); variants alternated call by call within each
round; ms per call, median (min) over ``--rounds`` x ``--repeats``; and the weight bytes one call
reads (trillm's packed layout: Q8_0 8.5 bits a value, Q4_0 4.5).

    python benchmarks/kernels/quant_gemm_avx2.py [--rows 1 16 256] [--rounds 3] [--repeats 5]
        [--threads N] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from trillm.kernels import linear_q_cpu

SHAPES = {"2048x8192": (2048, 8192), "8192x2048": (8192, 2048)}  # name -> (N, K)
TYPES = ("Q8_0", "Q4_0")
VARIANTS = ("avx2", "dequant", "f32")


def variants(weight: linear_q_cpu.QuantizedWeight) -> dict[str, Callable[[torch.Tensor], object]]:
    dense = linear_q_cpu.dequantize(weight)  # [N, K] fp32, made once for ``f32``
    return {
        "avx2": lambda x: linear_q_cpu.linear(x, weight),
        "dequant": lambda x: F.linear(x, linear_q_cpu.dequantize(weight)),
        "f32": lambda x: F.linear(x, dense),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_out = []
    with linear_q_cpu.use_isa("avx2"):
        for type_name in TYPES:
            for shape, (n, k) in SHAPES.items():
                values = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32)
                kind = GGMLQuantizationType[type_name]
                weight = linear_q_cpu.QuantizedWeight(
                    quants.quantize(values, kind), int(kind), n, k
                )
                calls = variants(weight)
                for m in args.rows:
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    for call in calls.values():  # warm up
                        call(x)
                    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                    for _ in range(args.rounds * args.repeats):
                        for name, call in calls.items():
                            start = time.perf_counter()
                            call(x)
                            times[name].append(time.perf_counter() - start)
                    row = dict(type=type_name, shape=shape, rows=m, weight_mb=weight.nbytes / 1e6)
                    for name, samples in times.items():
                        row[f"{name}_ms"] = statistics.median(samples) * 1e3
                        row[f"{name}_min_ms"] = min(samples) * 1e3
                    rows_out.append(row)
                    print(
                        f"{type_name} {shape} M={m:<4} {row['weight_mb']:6.1f} MB  "
                        + "  ".join(
                            f"{v} {row[f'{v}_ms']:8.2f} ({row[f'{v}_min_ms']:7.2f})"
                            for v in VARIANTS
                        ),
                        flush=True,
                    )
    if args.out:
        args.out.write_text(
            json.dumps(dict(threads=torch.get_num_threads(), rows=rows_out), indent=2)
        )


if __name__ == "__main__":
    main()
