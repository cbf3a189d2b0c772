"""The quantized GEMM's AVX2 kernel against what an AVX2-only CPU ran before it: one weight of
Llama-3.2-1B's shapes (``2048x8192``: down, N 2048 x K 8192; ``8192x2048``: gate / up, N 8192 x
K 2048) in Q8_0 and Q4_0, ``--rows`` rows of fp32 activations, per call:

- ``avx2``: ``linear_q_cpu.linear`` with the AVX2 kernel (``use_isa("avx2")``);
- ``dequant``: the fallback it replaces, ``F.linear(x, dequantize(W))`` each call;
- ``f32``: torch's ``F.linear`` on the weight dequantized once (4 bytes a value).

Random weights (the gguf package's quantizer); variants alternated call by call within each
round; ms per call, median (min) over ``--rounds`` x ``--repeats``; and the weight bytes one call
reads (trillm's packed layout: Q8_0 8.5 bits a value, Q4_0 4.5).

``--decode-stack``: instead, one decode token's linears (one row through a Llama-3.2-1B layer's
seven weights, 16 times: one layer's weights stand for all 16), ``avx2`` vs ``f32``, in the
calling thread's CPU time (with ``--threads 1`` all the work is on it; wall time on a shared
machine is noise).

    python benchmarks/kernels/quant_gemm_avx2.py [--rows 1 16 256] [--rounds 3] [--repeats 5]
        [--threads N] [--out x.json]
    python benchmarks/kernels/quant_gemm_avx2.py --decode-stack --threads 1
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


LAYER = (
    (2048, 2048),
    (512, 2048),
    (512, 2048),
    (2048, 2048),
    (8192, 2048),
    (8192, 2048),
    (2048, 8192),
)


def quantized(type_name: str, n: int, k: int, seed: int = 0) -> linear_q_cpu.QuantizedWeight:
    values = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    kind = GGMLQuantizationType[type_name]
    return linear_q_cpu.QuantizedWeight(quants.quantize(values, kind), int(kind), n, k)


def token_ms(run: Callable[[], object], repeats: int) -> str:
    """Thread CPU ms of 16 runs (a token's 16 layers), min (median) of ``repeats``."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(16):
            run()
        samples.append((time.thread_time() - start) * 1e3)
    return f"{min(samples):.1f} ({statistics.median(samples):.1f})"


def stack_line(type_name: str, repeats: int) -> str:
    weights = [quantized(type_name, n, k, seed=i) for i, (n, k) in enumerate(LAYER)]
    dense = [linear_q_cpu.dequantize(w) for w in weights]
    xs = {k: torch.randn(1, k) for _, k in LAYER}
    avx2 = token_ms(lambda: [linear_q_cpu.linear(xs[w.in_features], w) for w in weights], repeats)
    f32 = token_ms(lambda: [F.linear(xs[d.shape[1]], d) for d in dense], repeats)
    mb = 16 * sum(w.nbytes for w in weights) / 1e6
    return f"{type_name}: a token's linears, {mb:.0f} MB: avx2 {avx2}, f32 {f32} thread CPU ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--decode-stack", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode_stack:
        with linear_q_cpu.use_isa("avx2"):
            for type_name in TYPES:
                print(stack_line(type_name, args.repeats), flush=True)
        return
    rows_out = []
    with linear_q_cpu.use_isa("avx2"):
        for type_name in TYPES:
            for shape, (n, k) in SHAPES.items():
                weight = quantized(type_name, n, k)
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
