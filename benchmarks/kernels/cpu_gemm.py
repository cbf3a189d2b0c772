"""The packed-weight CPU GEMM (``kernels/linear_cpu.py``) against torch's ``F.linear`` on the
benchmark model's linear layers.

One "pass" multiplies a [rows, K] input by every linear weight of the model in forward order
(8 layers x qkv 512->1024, o 512->512, gate_up 512->2816, down 1408->512, then the lm_head
512->4096), as a forward pass does: 103 MB of fp32 weights, more than the last-level cache, so
each weight comes from memory as in a real step. The two are timed alternately, median of
``--repeats`` passes each, ``--rounds`` times.

    python benchmarks/kernels/cpu_gemm.py --threads 2 [--rows 8 32 64 256 2048] --out results/cpu_gemm.json

``--variants`` picks what is timed (alternately, in one run): ``torch`` (fp32 ``F.linear``),
``packed`` (the fp32 packed GEMM, its default kernel: AVX-512 where the CPU has it),
``packed_avx2`` (the same with its AVX2 kernel, bit-identical results), ``torch_bf16`` (``F.linear`` on bf16 weights and input),
``packed_bf16`` (the AVX512-BF16 GEMM of ``ext/cpu_gemm_bf16.cpp``, bf16 in and out).
``--model smollm2`` uses SmolLM2-135M's shapes instead (30 layers x qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576, lm_head 576->49152: 134.5 M parameters, 538 MB in fp32):

    python benchmarks/kernels/cpu_gemm.py --model smollm2 --rows 1 8 16 64 256 \
        --variants packed torch_bf16 packed_bf16 --out benchmarks/kernels/results/cpu_gemm_bf16.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import (
    common,  # benchmarks/common.py: thread setup (before torch loads), spec, output
)

# SmolLM2-135M-Instruct: the shapes only, the weights are random.
SMOLLM2_SPEC = dict(
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
)
VARIANTS = ("torch", "packed", "packed_avx2", "torch_bf16", "packed_bf16")


def model_shapes(spec: dict | None = None) -> list[tuple[int, int]]:
    """(out_features, in_features) of every linear layer, in forward order."""
    s = spec or common.MODEL_SPEC
    hidden, inter, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d
    layer = [(qkv, hidden), (s["num_attention_heads"] * d, hidden), (2 * inter, hidden)]
    layer.append((hidden, inter))
    return layer * s["num_hidden_layers"] + [(s["vocab_size"], hidden)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 96, 256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", choices=("bench", "smollm2"), default="bench")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["torch", "packed"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    common.set_threads(args.threads)
    import torch
    import torch.nn.functional as F

    from trillm.kernels import linear_cpu

    if {"packed", "packed_avx2"} & set(args.variants) and not linear_cpu.available():
        raise SystemExit("trillm._ext.cpu_kernels is not built (or no AVX2/FMA here).")
    if "packed_bf16" in args.variants and not linear_cpu.available_bf16():
        raise SystemExit("trillm._ext.cpu_kernels is not built (or no AVX512-BF16 here).")
    shapes = model_shapes(SMOLLM2_SPEC if args.model == "smollm2" else None)
    weights = [torch.randn(n, k) for n, k in shapes]
    weights16 = [w.to(torch.bfloat16) for w in weights]
    fp32_packed = {"packed", "packed_avx2"} & set(args.variants)
    packed = [linear_cpu.PackedWeight(w) for w in weights] if fp32_packed else []
    packed16 = (
        [linear_cpu.PackedWeightBf16(w) for w in weights16]
        if "packed_bf16" in args.variants
        else []
    )
    flops_per_row = 2 * sum(n * k for n, k in shapes)

    def median_s(fn: Callable[[], object], repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows_out = []
    for m in args.rows:
        inputs = {k: torch.randn(m, k) for k in {k for _, k in shapes}}
        inputs16 = {k: x.to(torch.bfloat16) for k, x in inputs.items()}
        repeats = max(3, args.repeats if m <= 256 else args.repeats // 2)

        def torch_pass(inputs=inputs) -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def packed_pass(inputs=inputs) -> None:
            for w, p in zip(weights, packed, strict=True):
                linear_cpu.linear(inputs[w.shape[1]], p)

        def packed_avx2_pass(inputs=inputs) -> None:
            with linear_cpu.use_isa("avx2"):
                packed_pass(inputs)

        def torch_bf16_pass(inputs16=inputs16) -> None:
            for w in weights16:
                F.linear(inputs16[w.shape[1]], w)

        def packed_bf16_pass(inputs16=inputs16) -> None:
            for w, p in zip(weights16, packed16, strict=True):
                linear_cpu.linear_bf16(inputs16[w.shape[1]], p)

        passes = dict(
            torch=torch_pass,
            packed=packed_pass,
            packed_avx2=packed_avx2_pass,
            torch_bf16=torch_bf16_pass,
            packed_bf16=packed_bf16_pass,
        )
        rates: dict[str, list[float]] = {name: [] for name in args.variants}
        for _ in range(args.rounds):
            for name in args.variants:
                rates[name].append(m * flops_per_row / median_s(passes[name], repeats) / 1e9)
        row: dict = dict(rows=m)
        for name in args.variants:
            row[f"{name}_gflops"] = statistics.mean(rates[name])
            row[f"{name}_rounds"] = rates[name]
        if "torch" in rates and "packed" in rates:
            row["speedup"] = row["packed_gflops"] / row["torch_gflops"]
        if "packed_avx2" in rates and "packed" in rates:
            row["vs_avx2"] = row["packed_gflops"] / row["packed_avx2_gflops"]
        if "packed_bf16" in rates:
            for base in ("torch_bf16", "packed", "torch"):
                if base in rates:
                    row[f"bf16_vs_{base}"] = row["packed_bf16_gflops"] / row[f"{base}_gflops"]
        rows_out.append(row)
    params = flops_per_row / 2
    print(f"{len(shapes)} weights, {params / 1e6:.1f} M params; {args.threads} threads")
    columns = [("rows", "d")] + [(f"{name}_gflops", ".1f") for name in args.variants]
    columns += [
        (key, ".2f")
        for key in rows_out[0]
        if key in ("speedup", "vs_avx2") or key.startswith("bf16_")
    ]
    common.print_table(rows_out, columns)
    common.write_json(
        args.out,
        dict(
            benchmark="cpu_gemm",
            machine=common.machine_info(),
            args=vars(args),
            params=params,
            rows=rows_out,
        ),
    )


if __name__ == "__main__":
    main()
