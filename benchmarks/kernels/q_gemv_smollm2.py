"""One decode row through SmolLM2-135M's quantized weights: a batch-1 token's GEMVs alone.

The Q4_1 GGUF's shapes (every layer's q/k/v stacked 960 x 576, o 576 x 576, gate/up stacked
3,072 x 576, down 576 x 1,536; the tied head 49,152 x 576 in Q8_0), random blocks with d and m
set so the values are O(1), 30 layers of distinct weights (66 MB packed: out of cache, as in
the model) and the head. One fp32 row (``--x-dtype bfloat16``: bf16) goes through them in model
order, ``--passes`` per round, ``--rounds`` rounds; per shape and in all, the median ms a pass
and the packed bytes read over it (GB/s). ``--hot`` runs each shape's first layer only, again and again (its weights in
cache). ``--clock thread``: the calling thread's CPU time (with ``--threads 1`` the kernel's
whole cost; on a shared machine wall time is noise). ``--ext PATH`` loads another build's
``cpu_kernels`` extension (a copy of ``trillm/_ext/cpu_kernels*.so``) in place of the tree's:
run it alternately with and without to compare two kernels. ``--isa avx2``: the AVX2 kernel.

    python benchmarks/kernels/q_gemv_smollm2.py [--threads 1] [--clock thread] [--hot]
        [--rounds 5] [--passes 3] [--ext /tmp/before/cpu_kernels.so] [--out x.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: trillm

import numpy as np
import torch

LAYERS = 30
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))
HEAD = ("head", 49152, 576)
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def load_ext(path: str) -> None:
    """Make ``trillm._ext.cpu_kernels`` the extension at ``path`` (before trillm imports it)."""
    spec = importlib.util.spec_from_file_location("trillm._ext.cpu_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trillm._ext.cpu_kernels"] = module
    spec.loader.exec_module(module)


def random_weight(lq, type_name: str, n: int, k: int, rng: np.random.Generator):
    blocks = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[type_name]), dtype=np.uint8)
    d = np.full((n, k // 32), 0.01 if type_name == "Q8_0" else 0.1, np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    if type_name == "Q4_1":
        m = np.full((n, k // 32), -0.75, np.float16)
        blocks[:, :, 2:4] = m.view(np.uint8).reshape(n, k // 32, 2)
    qtype = lq.Q4_1 if type_name == "Q4_1" else lq.Q8_0
    return lq.QuantizedWeight(blocks.reshape(n, -1), qtype, n, k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["wall", "thread"], default="thread")
    p.add_argument("--hot", action="store_true")
    p.add_argument("--isa", default=None, choices=["avx512", "avx2"])
    p.add_argument("--x-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--ext", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.ext:
        load_ext(args.ext)
    from trillm.kernels import linear_q_cpu as lq

    ext = lq._ext()
    assert ext is not None, "the cpu_kernels extension is not built"
    if args.isa:
        ext.set_isa(args.isa)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    rng = np.random.default_rng(0)
    layers = 1 if args.hot else LAYERS
    reps = 20 if args.hot else 1
    weights = {
        name: [random_weight(lq, "Q4_1", n, k, rng) for _ in range(layers)] for name, n, k in SHAPES
    }
    weights["head"] = [random_weight(lq, "Q8_0", HEAD[1], HEAD[2], rng)]
    calls = []  # (shape name, ext.linear's arguments), in model order
    x = torch.randn(1, 1536).to(getattr(torch, args.x_dtype))
    xb = args.x_dtype == "bfloat16"
    outs = {name: torch.empty(1, n) for name, n, _ in (*SHAPES, HEAD)}
    for layer in range(layers):
        for name, n, k in SHAPES:
            w = weights[name][layer]
            y = outs[name]
            calls.append(
                (
                    name,
                    (
                        x.data_ptr(),
                        xb,
                        1,
                        k,
                        k,
                        w.data.data_ptr(),
                        w.kernel_type,
                        n,
                        0,
                        y.data_ptr(),
                        False,
                        n,
                        args.threads,
                        False,
                    ),
                )
            )
    w = weights["head"][0]
    calls.append(
        (
            "head",
            (
                x.data_ptr(),
                xb,
                1,
                HEAD[2],
                HEAD[2],
                w.data.data_ptr(),
                w.kernel_type,
                HEAD[1],
                0,
                outs["head"].data_ptr(),
                False,
                HEAD[1],
                args.threads,
                False,
            ),
        )
    )
    names = [name for name, _, _ in (*SHAPES, HEAD)]
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for _ in range(args.passes):
            spent = dict.fromkeys(names, 0.0)
            for name, a in calls:
                t0 = clock()
                for _ in range(reps):
                    ext.linear(*a)
                spent[name] += (clock() - t0) / reps
            for name in names:
                times[name].append(spent[name])
    nbytes = {name: sum(w.data.numel() for w in weights[name]) for name in names}
    result = {}
    for name in names:
        ms = statistics.median(times[name]) * 1e3
        result[name] = dict(
            ms=round(ms, 4), gb_s=round(nbytes[name] / ms / 1e6, 2), mb=round(nbytes[name] / 1e6, 3)
        )
    layers_ms = (
        statistics.median([sum(times[n][i] for n, _, _ in SHAPES) for i in range(len(times["o"]))])
        * 1e3
    )
    total_ms = (
        statistics.median([sum(times[n][i] for n in names) for i in range(len(times["o"]))]) * 1e3
    )
    result["layers"] = dict(
        ms=round(layers_ms, 3),
        gb_s=round(sum(nbytes[n] for n, _, _ in SHAPES) / layers_ms / 1e6, 2),
    )
    result["token"] = dict(
        ms=round(total_ms, 3), gb_s=round(sum(nbytes.values()) / total_ms / 1e6, 2)
    )
    info = dict(
        isa=args.isa or "default",
        x_dtype=args.x_dtype,
        threads=args.threads,
        clock=args.clock,
        hot=args.hot,
        layers=layers,
        ext=args.ext or "tree",
    )
    print(json.dumps(info))
    for name, r in result.items():
        print(f"  {name:8s} {r['ms']:9.3f} ms  {r['gb_s']:6.2f} GB/s")
    if args.out:
        args.out.write_text(json.dumps(dict(info=info, result=result), indent=2) + "\n")


if __name__ == "__main__":
    main()
