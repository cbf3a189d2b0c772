"""Perplexity with int8 activations simulated in torch: W . x^ (the dequantized weight times the
activations rounded per block of ``B`` values, as the kernel computes it), x jittered by a
relative 1e-6 before rounding (seed s), to see how much of int8's perplexity change is the luck
of which values round which way. ``B`` 0: fp32 activations (the jitter alone: the control).

    python benchmarks/numerics/int8_act_sim.py MODEL.gguf {builtin|TEXT_FILE} B:SEED [B:SEED ...] \\
        [--out x.json]

The layers that run int8 activations (``INT8_MIN_ROWS`` rows and up) go through the simulation;
the others through the native kernel as served.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch
import torch.nn.functional as F

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from benchmarks.numerics import q4_perplexity as qp
from trillm.kernels import linear_q_cpu


def rounded(x: torch.Tensor, block: int) -> torch.Tensor:  # [M, K] -> [M, K]
    m, k = x.shape
    b = x.reshape(m, k // block, block)
    dx = b.abs().amax(dim=2, keepdim=True) / 127.0
    safe = torch.where(dx > 0, dx, torch.ones_like(dx))
    q = torch.where(dx > 0, torch.round(b / safe), torch.zeros_like(b)).clamp(-127, 127)
    return (q * dx).reshape(m, k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("text")
    p.add_argument("runs", nargs="+", help="BLOCK:SEED")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    text = qp.TEXT if args.text == "builtin" else Path(args.text).read_text()
    native = linear_q_cpu.linear
    cache: dict[int, torch.Tensor] = {}  # id(weight) -> dequantized, for one engine's life
    rows = []
    for spec in args.runs:
        block, seed = (int(v) for v in spec.split(":"))
        gen = torch.Generator().manual_seed(seed)

        def linear(
            x, weight, bias=None, out_dtype=None, int8_activations=False, block=block, gen=gen
        ):
            if not int8_activations:
                return native(x, weight, bias, out_dtype, False)
            w = cache.get(id(weight))
            if w is None:
                w = cache[id(weight)] = linear_q_cpu.dequantize(weight)
            xs = x.reshape(-1, w.shape[1]).float()
            xs = xs * (1 + 1e-6 * torch.randn(xs.shape, generator=gen))
            y = F.linear(rounded(xs, block) if block else xs, w, bias)
            return y.view(*x.shape[:-1], w.shape[0])

        linear_q_cpu.linear = linear
        ppl, n = qp.perplexity(args.model, linear_q_cpu.INT8_MIN_ROWS, text)
        cache.clear()
        rows.append(dict(block=block, seed=seed, perplexity=ppl, tokens=n))
        print(f"block {block} seed {seed}: ppl {ppl:.4f} over {n} tokens", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
