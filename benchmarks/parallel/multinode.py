"""Offline throughput of tensor_parallel_size 2 on one node vs the same two ranks as two
"nodes" on loopback: what rank 0's relay of each step to the other node costs.

Each (round, layout) runs in a fresh child process (``--child``) that opens ``LLM`` with
``tensor_parallel_size=2`` (``--layout one-node``) or with ``nnodes=2`` while a
``trillm serve --headless --node-rank 1`` process runs rank 1 (``--layout two-nodes``), runs a
one-request warm-up, then the workload (greedy, ``ignore_eos``, fixed lengths). Both layouts
share this machine's cores the same way (one rank per core share); the difference is the
relay (``OMP_NUM_THREADS`` is set to half the cores in both): on two nodes rank 1 gets each step by a gloo broadcast from rank 0 (not the
shared-memory ring) and sends its output back to rank 0 (``trillm/distributed/node_link.py``).
Every rank prints its collective time per forward step on shutdown (parsed here; the relay's
own broadcasts are not counted there: they show in ms_per_step).

    python benchmarks/parallel/multinode.py --out benchmarks/parallel/results/multinode.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common
from benchmarks.parallel.tensor_parallel import RANK_LINE

LAYOUTS = ("one-node", "two-nodes")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the bench model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", choices=LAYOUTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--master-port", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_child(args: argparse.Namespace) -> None:
    """One LLM in ``args.child``'s layout; prints a JSON line on stdout."""
    from trillm import LLM, SamplingParams

    jobs = common.make_workload(
        args.num_prompts, 0, (args.prompt_len, args.prompt_len), (args.output_len,) * 2
    )
    prompts = [{"prompt_token_ids": j.prompt_ids} for j in jobs]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    engine = {
        "tensor_parallel_size": 2,
        "kv_cache_memory": "256MiB",
        "max_model_len": 512,
        "enable_prefix_caching": False,
    }
    if args.child == "two-nodes":
        engine |= {"nnodes": 2, "master_port": args.master_port}
    with LLM(args.model, **engine) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"seconds": seconds, "output_tokens": tokens}), flush=True)


def measure(args: argparse.Namespace, model: str, layout: str) -> dict[str, Any]:
    # Two nodes on one machine would each give their one rank all the cores: pin both
    # layouts to one half each, as one node gives its two ranks.
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    env = {**os.environ, "PYTHONPATH": str(common.REPO_ROOT), "OMP_NUM_THREADS": threads}
    port = common.free_port()
    argv = [
        sys.executable,
        __file__,
        "--child",
        layout,
        "--model",
        model,
        "--num-prompts",
        str(args.num_prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
    ]
    node1 = None
    if layout == "two-nodes":
        argv += ["--master-port", str(port)]
        node1 = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trillm",
                "serve",
                model,
                "-tp",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--headless",
                "--master-port",
                str(port),
                "--kv-cache-memory",
                "256MiB",
                "--max-model-len",
                "512",
                "--no-enable-prefix-caching",
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    stderr = done.stderr
    if node1 is not None:
        stderr += node1.communicate(timeout=120)[1]
    if done.returncode != 0:
        raise RuntimeError(f"{layout} run failed:\n{stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ranks = [(int(r), int(s), float(c)) for r, s, c in RANK_LINE.findall(stderr)]
    steps = max(s for _, s, _ in ranks)
    row: dict[str, Any] = {
        "layout": layout,
        "seconds": result["seconds"],
        "output_tok_s": result["output_tokens"] / result["seconds"],
        "forward_steps": steps,
        "ms_per_step": 1e3 * result["seconds"] / steps,
    }
    for rank, _, comm in sorted(ranks):
        row[f"comm_ms_per_step_rank{rank}"] = 1e3 * comm / steps
    return row


def main() -> None:
    args = parse_args()
    if args.child is not None:
        run_child(args)
        return
    model = args.model or str(common.build_bench_model())
    machine = common.machine_info()
    rows = []
    for round_ in range(args.rounds):
        for layout in LAYOUTS:
            row = {"round": round_, **measure(args, model, layout)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    columns = [
        ("round", "d"),
        ("layout", "s"),
        ("seconds", ".2f"),
        ("output_tok_s", ".1f"),
        ("forward_steps", "d"),
        ("ms_per_step", ".2f"),
        ("comm_ms_per_step_rank0", ".2f"),
        ("comm_ms_per_step_rank1", ".2f"),
    ]
    common.print_table(rows, columns)
    command = "python benchmarks/parallel/multinode.py " + " ".join(sys.argv[1:])
    common.write_json(
        args.out,
        {"machine": machine, "command": command, "args": vars(args) | {"out": None}, "rows": rows},
    )


if __name__ == "__main__":
    main()
