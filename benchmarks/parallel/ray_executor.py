"""Start-up, per-step and stop time of tensor_parallel_size 2 over the multiprocessing executor
(``mp``: worker processes, shared-memory rings) vs the Ray executor (``ray``: Ray actors, one
Ray call per rank per step), on a tiny random Llama whose forward costs little, so that what
differs is the executor's own cost.

Each (round, layout) runs in a fresh child process (``--child``): it opens ``LLM`` (timed: the
start-up, from the constructor to the KV cache allocated), runs a one-request warm-up, then one
request of ``--output-len`` greedy tokens (timed: ms per decode step), then shuts down (timed).
Layouts: ``mp``; ``ray-local`` (the engine starts a local Ray cluster and stops it);
``ray-joined`` (``RAY_ADDRESS`` names a head node started here beforehand, as a deployment
would have one running; its own start is not counted). Rounds alternate the layouts.

    python benchmarks/parallel/ray_executor.py --rounds 2 \
        --out benchmarks/parallel/results/ray_executor.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common

LAYOUTS = ("mp", "ray-local", "ray-joined")
LIMITS = {"max_model_len": 256, "kv_cache_memory": "16MiB"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--call-rtt", type=int, default=0, help="also time N empty Ray calls to a rank actor"
    )
    p.add_argument("--child", choices=LAYOUTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_child(args: argparse.Namespace) -> None:
    """One TP=2 LLM in ``args.child``'s layout; prints a JSON line on stdout."""
    from trillm.engine.llm import LLM
    from trillm.sampling_params import SamplingParams

    backend = "mp" if args.child == "mp" else "ray"
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(args.model, distributed_executor_backend=backend, tensor_parallel_size=2, **LIMITS)
    started = time.perf_counter()
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(["Hello there"], params, use_tqdm=False)
    decoded = time.perf_counter()
    llm.shutdown()
    stopped = time.perf_counter()
    row = {
        "layout": args.child,
        "startup_s": round(started - t0, 3),
        "ms_per_decode_step": round((decoded - t1) * 1000 / args.output_len, 3),
        "shutdown_s": round(stopped - decoded, 3),
    }
    print(json.dumps(row), flush=True)


def measure(layout: str, model: str, output_len: int, env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", layout, "--model", model]
    argv += ["--output-len", str(output_len)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{layout} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(lines[-1])
    return row


def measure_joined(model: str, output_len: int, env: dict[str, str]) -> dict[str, Any]:
    """``ray-joined``: a head node started here first (Ray's own ``ray start --head`` code, its
    processes stopped by this handle alone), named by RAY_ADDRESS."""
    from ray.cluster_utils import Cluster

    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    try:
        return measure("ray-joined", model, output_len, {**env, "RAY_ADDRESS": head.address})
    finally:
        head.shutdown()


def call_rtt_ms(calls: int) -> dict[str, float]:
    """Round trip of an empty call (``RankActor.ping``) to one rank actor of a local cluster:
    the floor of the Ray executor's cost per message and rank."""
    import statistics

    import ray

    from trillm.executor.ray_actor import RankActor

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=1)(RankActor).remote(0)
        ray.get(actor.ping.remote())
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(actor.ping.remote())
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        ray.shutdown()
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    from trillm.testing.tiny_models import build_tiny_model

    model = str(build_tiny_model("llama", Path(tempfile.mkdtemp(prefix="ray-bench-"))))
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    base["RAY_USAGE_STATS_ENABLED"] = "0"
    rows = []
    for round_ in range(args.rounds):
        for layout in args.layouts:
            if layout == "ray-joined":
                row = measure_joined(model, args.output_len, base)
            else:
                row = measure(layout, model, args.output_len, base)
            print(json.dumps({"round": round_, **row}), flush=True)
            rows.append({"round": round_, **row})
    columns = [("round", "d"), ("layout", "s"), ("startup_s", ".2f")]
    if rows:
        columns += [("ms_per_decode_step", ".2f"), ("shutdown_s", ".2f")]
        common.print_table(rows, columns)
    result: dict[str, Any] = {"machine": common.machine_info(), "rows": rows}
    if args.call_rtt:
        result["ray_call_rtt"] = call_rtt_ms(args.call_rtt)
        print("ray call round trip:", result["ray_call_rtt"])
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
