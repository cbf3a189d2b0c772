"""The quantized linears at batched-decode row counts (M = 2 .. 48) at Llama-3.2-1B's shapes.

Each of the 1B's linears as its layers call them (one call per stacked part: q / o 2048x2048,
k / v 512x2048, gate / up 8192x2048, down 2048x8192; with ``--head`` the tied 128,256 x 2048
head) for Q4_0 / Q8_0 / Q4_K weights (random blocks; Q6_K head as Q6_KP where the CPU runs it),
or the K-quant kernel forms: Q6_KP (GGUF's Q6_K where the CPU has AVX512-BF16 and VBMI), Q6_K
(its 9-bit records, as other CPUs pack it), Q5_KM (GGUF's Q5_K), Q4_KM (GGUF's Q3_K);
x bf16, as the model dispatches it (``linear_q_cpu.use_int8``: int8 activations from
``INT8_MIN_ROWS`` rows, else bf16 rows); ``--int8 always|never`` forces the path. Per (type,
shape, M, threads): median CPU time of the process (all threads) per call and the GOP a
core-second (2 M N K ops / CPU s), and the wall ms; ``--step``: the sum over one decode step's
linears (16 layers, head included with ``--head``). Types alternate call by call.
``--unpacked-from R ...``: the int8 rows run the unpack-once prefill kernel from R rows on, every
type (the native module's private ``_set_int8_unpacked_min_rows``; 0: each type's own, 1:
always, 64: ``tile_vnni`` below 64 rows), each R in turn call by call: both kernels side by side.

    python benchmarks/kernels/q_small_m.py --rows 2 4 8 16 32 48 --threads 1 2 --step \
        [--types Q4_0 Q8_0 Q4_K] [--head] [--int8 model|always|never] [--rounds 5] [--out x.json]
    python benchmarks/kernels/q_small_m.py --types Q6_KP Q6_K Q5_KM Q4_KM --head --int8 always \
        --rows 1 4 8 16 32 48 --threads 1 --unpacked-from 1 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trillm.kernels import linear_q_cpu, q_panels  # noqa: E402
from trillm.testing.gguf_models import random_kquant_blocks  # noqa: E402

# (name, N, K, calls per decode step: 16 layers x parts of that shape)
SHAPES = (
    ("q_o", 2048, 2048, 32),
    ("k_v", 512, 2048, 32),
    ("gate_up", 8192, 2048, 32),
    ("down", 2048, 8192, 16),
)
HEAD = ("head", 128256, 2048, 1)
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}
TYPE_IDS = {"Q4_0": linear_q_cpu.Q4_0, "Q8_0": linear_q_cpu.Q8_0, "Q4_K": linear_q_cpu.Q4_K}
# the K-quant kernel forms: (the GGUF type whose random blocks make them, the kernel's type)
KQUANT_FORMS = {
    "Q6_KP": ("Q6_K", linear_q_cpu.Q6_KP),
    "Q6_K": ("Q6_K", linear_q_cpu.Q6_K),
    "Q5_KM": ("Q5_K", linear_q_cpu.Q5_KM),
    "Q4_KM": ("Q3_K", linear_q_cpu.Q4_KM),
}


def random_weight(type_name: str, n: int, k: int, seed: int) -> linear_q_cpu.QuantizedWeight:
    if type_name in KQUANT_FORMS:
        ggml, kernel = KQUANT_FORMS[type_name]
        raw = random_kquant_blocks(ggml, n, k, seed)
        w = linear_q_cpu.QuantizedWeight(raw, getattr(linear_q_cpu, ggml), n, k)
        if w.kernel_type != kernel and kernel == linear_q_cpu.Q6_K:  # the 9-bit records
            q, params = linear_q_cpu.unpack_ggml(raw, linear_q_cpu.Q6_K, k)
            w.kernel_type = kernel
            w.data = torch.from_numpy(q_panels.pack(q, params, kernel))
        if w.kernel_type != kernel:
            raise SystemExit(f"{type_name}: this CPU packs {ggml} as type {w.kernel_type}")
        return w
    if type_name in ("Q4_K", "Q6_K"):
        raw = random_kquant_blocks(type_name, n, k, seed)
        return linear_q_cpu.QuantizedWeight(raw, getattr(linear_q_cpu, type_name), n, k)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[type_name]), dtype=np.uint8)
    d = np.full((n, k // 32), 0.01 if type_name == "Q8_0" else 0.1, np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    return linear_q_cpu.QuantizedWeight(blocks.reshape(n, -1), TYPE_IDS[type_name], n, k)


def set_unpacked_from(rows: int) -> None:
    ext = linear_q_cpu._ext()
    if ext is not None and hasattr(ext, "_set_int8_unpacked_min_rows"):
        ext._set_int8_unpacked_min_rows(rows)
    elif rows:
        raise SystemExit("--unpacked-from: this build has no _set_int8_unpacked_min_rows")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--types", nargs="+", default=["Q4_0", "Q8_0"], choices=[*TYPE_IDS, *KQUANT_FORMS]
    )
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 48])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--head", action="store_true", help="also the Q6_K head (128,256 x 2048)")
    p.add_argument("--int8", choices=["model", "always", "never"], default="model")
    p.add_argument("--step", action="store_true", help="print one decode step's linears' sum")
    p.add_argument("--unpacked-from", type=int, nargs="+", default=[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    weights: dict[tuple[str, str], Any] = {}
    for i, (name, n, k, _) in enumerate(SHAPES):
        for t in args.types:
            weights[(t, name)] = random_weight(t, n, k, seed=i)
    if args.head:
        head = (
            "Q6_KP" if linear_q_cpu.kernel_type(linear_q_cpu.Q6_K) == linear_q_cpu.Q6_KP else "Q6_K"
        )
        weights[(head, "head")] = random_weight(head, HEAD[1], HEAD[2], seed=9)
    g = torch.Generator().manual_seed(0)
    xs = {
        (m, k): torch.randn(m, k, generator=g).bfloat16() for m in args.rows for k in (2048, 8192)
    }
    result: dict[str, Any] = dict(argv=sys.argv[1:], load_start=os.getloadavg(), rows=[])
    for threads in args.threads:
        torch.set_num_threads(threads)
        samples: dict[tuple[str, str, int, int], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for m in args.rows:
                for (t, name), w in weights.items():
                    x = xs[(m, w.in_features)]
                    int8 = dict(always=True, never=False).get(
                        args.int8, linear_q_cpu.use_int8(w, m)
                    )
                    for unpacked_from in args.unpacked_from:
                        set_unpacked_from(unpacked_from)
                        linear_q_cpu.linear(x, w, int8_activations=int8)  # warm
                        c, s = time.process_time(), time.perf_counter()
                        linear_q_cpu.linear(x, w, int8_activations=int8)
                        wall, cpu = time.perf_counter() - s, time.process_time() - c
                        samples.setdefault((t, name, m, unpacked_from), []).append((cpu, wall))
        set_unpacked_from(0)
        shapes = {s[0]: s for s in (*SHAPES, HEAD)}
        for (t, name, m, unpacked_from), v in samples.items():
            _, n, k, calls = shapes[name]
            cpu = statistics.median(c for c, _ in v)
            wall = statistics.median(w for _, w in v)
            row = dict(
                type=t,
                shape=name,
                n=n,
                k=k,
                m=m,
                unpacked_from=unpacked_from,
                threads=threads,
                calls=calls,
                cpu_ms=cpu * 1e3,
                wall_ms=wall * 1e3,
                gops_core=2 * m * n * k / cpu / 1e9,
            )
            result["rows"].append(row)
            print(
                f"{threads}t {t:5} {name:8} M={m:3} u{unpacked_from:<2} cpu {row['cpu_ms']:8.3f} ms  wall "
                f"{row['wall_ms']:8.3f} ms  {row['gops_core']:6.1f} GOP/core-s"
            )
        if args.step:
            for t in args.types:
                for m in args.rows:
                    for u in args.unpacked_from:
                        rs = [
                            r
                            for r in result["rows"]
                            if r["threads"] == threads
                            and r["m"] == m
                            and r["unpacked_from"] == u
                            and (r["type"] == t or (r["shape"] == "head"))
                        ]
                        cpu = sum(r["cpu_ms"] * r["calls"] for r in rs)
                        wall = sum(r["wall_ms"] * r["calls"] for r in rs)
                        print(
                            f"step {threads}t {t} M={m} u{u}: linears cpu {cpu:.1f} ms, "
                            f"wall {wall:.1f} ms"
                        )
    result["load_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
