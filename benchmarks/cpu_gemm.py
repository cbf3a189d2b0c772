"""The packed-weight CPU GEMM (``kernels/linear_cpu.py``) against torch's ``F.linear`` on the
benchmark model's linear layers.

One "pass" multiplies a [rows, K] input by every linear weight of the model in forward order
(8 layers x qkv 512->1024, o 512->512, gate_up 512->2816, down 1408->512, then the lm_head
512->4096), as a forward pass does: 103 MB of fp32 weights, more than the last-level cache, so
each weight comes from memory as in a real step. The two are timed alternately, median of
``--repeats`` passes each, ``--rounds`` times.

    python benchmarks/cpu_gemm.py --threads 2 [--rows 8 32 64 256 2048] --out results/cpu_gemm.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import common  # benchmarks/common.py: thread setup (before torch loads), spec, output


def model_shapes() -> list[tuple[int, int]]:
    """(out_features, in_features) of every linear layer, in forward order."""
    s = common.MODEL_SPEC
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    common.set_threads(args.threads)
    import torch
    import torch.nn.functional as F
    from trillm.kernels import linear_cpu

    if not linear_cpu.available():
        raise SystemExit("trillm._ext.cpu_kernels is not built (or no AVX2/FMA here).")
    shapes = model_shapes()
    weights = [torch.randn(n, k) for n, k in shapes]
    packed = [linear_cpu.PackedWeight(w) for w in weights]
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
        repeats = max(3, args.repeats if m <= 256 else args.repeats // 2)

        def torch_pass(inputs=inputs) -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def packed_pass(inputs=inputs) -> None:
            for w, p in zip(weights, packed, strict=True):
                linear_cpu.linear(inputs[w.shape[1]], p)

        rates: dict[str, list[float]] = {"torch": [], "packed": []}
        for _ in range(args.rounds):
            for name, fn in (("torch", torch_pass), ("packed", packed_pass)):
                rates[name].append(m * flops_per_row / median_s(fn, repeats) / 1e9)
        row = dict(
            rows=m,
            torch_gflops=statistics.mean(rates["torch"]),
            packed_gflops=statistics.mean(rates["packed"]),
            torch_rounds=rates["torch"],
            packed_rounds=rates["packed"],
        )
        row["speedup"] = row["packed_gflops"] / row["torch_gflops"]
        rows_out.append(row)
    print(f"{len(shapes)} weights, {flops_per_row / 2 / 1e6:.1f} M params; {args.threads} threads")
    common.print_table(
        rows_out,
        [("rows", "d"), ("torch_gflops", ".1f"), ("packed_gflops", ".1f"), ("speedup", ".2f")],
    )
    common.write_json(
        args.out,
        dict(benchmark="cpu_gemm", machine=common.machine_info(), args=vars(args), rows=rows_out),
    )


if __name__ == "__main__":
    main()
