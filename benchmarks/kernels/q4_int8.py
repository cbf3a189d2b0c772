"""The 4-bit GEMM with fp32 activations (FMA) against int8 activations (VNNI), on a real model.

The weights: every quantized projection of SmolLM2-135M-Instruct's Q4_1 GGUF, stacked as trillm
runs them (q/k/v and gate/up concatenated by rows): 30 layers x 4 GEMMs, K 576 or 1536. For each
batch (rows of x), one "step" is those 120 GEMMs in a row, as a decode step calls them; each
variant runs ``--steps`` steps, alternated over ``--rounds`` rounds; the median and the minimum
of the step times (on a shared, busy machine the minimum is the less disturbed figure).
Also the int8 path's error against the fp32 one (max |diff| / max |fp32 output|, per GEMM, the
worst) on random activations.

    python benchmarks/kernels/q4_int8.py --gguf G.gguf [--batches 1 16] [--steps 20] [--rounds 5]
        [--threads N] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from trillm.kernels import linear_q_cpu
from trillm.model_executor import gguf_loader
from trillm.model_executor.layers.quantized_linear import gguf_weight

STACKS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def load_weights(path: Path) -> list[linear_q_cpu.AnyQuantizedWeight]:
    by_name = {t.name: t for t in gguf_loader.GGUFFile(path).tensors()}
    weights = []
    layer = 0
    while f"model.layers.{layer}.self_attn.q_proj.weight" in by_name:
        for stack in STACKS:
            block = "mlp" if stack[0] in ("gate_proj", "down_proj") else "self_attn"
            parts = [by_name[f"model.layers.{layer}.{block}.{s}.weight"] for s in stack]
            weights.append(gguf_weight(parts, parts[0].shape[1]))  # a part per type, as served
        layer += 1
    return weights


def step(weights: list[linear_q_cpu.AnyQuantizedWeight], xs: dict[int, torch.Tensor], int8: bool):
    for w in weights:
        linear_q_cpu.linear(xs[w.in_features], w, int8_activations=int8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert linear_q_cpu.int8_available(), "needs the native kernel and AVX512-VNNI"
    weights = load_weights(args.gguf)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        xs = {k: torch.randn(batch, k, generator=gen) for k in {w.in_features for w in weights}}
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for int8 in (False, True):
                step(weights, xs, int8)  # warm
                for _ in range(args.steps):
                    start = time.perf_counter()
                    step(weights, xs, int8)
                    times[int8].append(time.perf_counter() - start)
        err = max(
            float(
                (
                    linear_q_cpu.linear(xs[w.in_features], w, int8_activations=True)
                    - (ref := linear_q_cpu.linear(xs[w.in_features], w))
                )
                .abs()
                .max()
                / ref.abs().max()
            )
            for w in weights
        )
        fma, vnni = statistics.median(times[False]), statistics.median(times[True])
        fma_min, vnni_min = min(times[False]), min(times[True])
        rows.append(
            dict(
                batch=batch,
                fp32_fma_ms=fma * 1e3,
                int8_vnni_ms=vnni * 1e3,
                speedup=fma / vnni,
                fp32_fma_min_ms=fma_min * 1e3,
                int8_vnni_min_ms=vnni_min * 1e3,
                speedup_min=fma_min / vnni_min,
                max_rel_err=err,
            )
        )
    print(
        f"{torch.get_num_threads()} threads, {len(weights)} GEMMs a step, "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    print("step ms, median (min) of the steps")
    print(f"{'batch':>5} {'fp32-FMA':>16} {'int8-VNNI':>16} {'speedup':>12} {'max rel err':>12}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['fp32_fma_ms']:>7.2f} ({r['fp32_fma_min_ms']:>6.2f}) "
            f"{r['int8_vnni_ms']:>7.2f} ({r['int8_vnni_min_ms']:>6.2f}) "
            f"{r['speedup']:>5.2f} ({r['speedup_min']:>4.2f}) {r['max_rel_err']:>12.2e}"
        )
    if args.out:
        args.out.write_text(json.dumps(dict(threads=torch.get_num_threads(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
