"""Offline throughput at data_parallel_size 1 and 2 (or more) (issue 14).

Each (round, DP size) runs in a fresh child process (``--child``): it opens ``LLM`` with the
size (K engine cores, each with its own worker process, scheduler and KV cache), runs a
one-request warm-up, then the workload (greedy, ``ignore_eos``, fixed lengths, distinct
prompts, prefix caching off so that routing is by load alone), and reports the wall time and
how many requests each core took. The sizes alternate within each round.

On CPU the cores' workers share the machine's cores (each takes cores // K threads), so on
this 2-core machine expect little or no gain: data parallelism adds compute only where there
are more devices (one GPU per engine core).

    python benchmarks/data_parallel.py --out benchmarks/results/data_parallel.json
    # a multi-GPU machine (one GPU per engine core):
    python benchmarks/data_parallel.py --device cuda --dp-sizes 1,2 --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the bench model)")
    p.add_argument("--dp-sizes", default="1,2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_child(args: argparse.Namespace) -> None:
    """One LLM at data_parallel_size ``args.child``; prints a JSON line on stdout."""
    from trillm import LLM, SamplingParams

    jobs = common.make_workload(
        args.num_prompts, 0, (args.prompt_len, args.prompt_len), (args.output_len,) * 2
    )
    prompts = [{"prompt_token_ids": j.prompt_ids} for j in jobs]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm = LLM(
        args.model, data_parallel_size=args.child, device=args.device, dtype=args.dtype,
        kv_cache_memory="512MiB", max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
    )  # fmt: skip
    with llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        router = llm.engine.router
        before = list(router.routed) if router is not None else [1]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = list(router.routed) if router is not None else [1 + len(prompts)]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    routed = [a - b for a, b in zip(after, before)]
    print(json.dumps({"seconds": seconds, "output_tokens": tokens, "routed": routed}), flush=True)


def measure(args: argparse.Namespace, model: str, dp: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", str(dp), "--model", model,
            "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
            "--output-len", str(args.output_len), "--max-num-seqs", str(args.max_num_seqs),
            "--device", args.device, "--dtype", args.dtype]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(common.REPO_ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"DP={dp} run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "dp": dp,
        "seconds": result["seconds"],
        "output_tok_s": result["output_tokens"] / result["seconds"],
        "routed": "/".join(str(n) for n in result["routed"]),
    }


def main() -> None:
    args = parse_args()
    if args.child is not None:
        run_child(args)
        return
    model = args.model or str(common.build_bench_model())
    sizes = [int(s) for s in args.dp_sizes.split(",")]
    machine = common.machine_info()
    load_before = os.getloadavg()[0]
    rows = []
    for round_ in range(args.rounds):
        for dp in sizes:
            row = {"round": round_, **measure(args, model, dp), "load_1m": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    columns = [("round", "d"), ("dp", "d"), ("seconds", ".2f"), ("output_tok_s", ".1f"),
               ("routed", "s"), ("load_1m", ".1f")]  # fmt: skip
    if rows:
        common.print_table(rows, columns)
    command = "python benchmarks/data_parallel.py " + " ".join(sys.argv[1:])
    common.write_json(
        args.out, {"machine": machine, "command": command, "args": vars(args) | {"out": None},
                   "load_1m_before": load_before, "rows": rows},
    )  # fmt: skip


if __name__ == "__main__":
    main()
