"""Offline throughput at tensor_parallel_size 1 and 2 (or more), and pipeline_parallel_size 2
(``--pp-sizes``), and the time each rank spends in collectives per forward step.
With ``--pp-micro-batches 2,1`` each pipeline size runs once per number of steps in flight
(``TRILLM_PP_MICRO_BATCHES``); the child samples how many steps are in flight every 2 ms (the
share of the timed run's wall time at 0, 1, 2 ... in flight) and counts the sends by depth.

Each (round, TP size) runs in a fresh child process (``--child``): it opens ``LLM`` with the
size, runs a one-request warm-up, then the workload (greedy, ``ignore_eos``, fixed lengths),
and reports the wall time. On shutdown every worker prints ``tensor-parallel rank r: S forward
steps, X s in collectives (Y ms per step)``; the parent reads those lines from the child's
stderr. Collective time is wall time inside ``all_reduce`` / ``all_gather`` (2 all-reduces per
layer, one for the embedding, one all-gather of the logits per forward), so it includes
waiting for the slower rank. With pipeline stages it is the time in the stage hand-offs
(send / recv of the hidden states), so it includes a stage's wait for the stages next to it. The sizes alternate within each round.

``--allreduce-rows`` adds the cost of the collective alone: two fresh processes (gloo on CPU,
NCCL on GPU) all-reduce a [rows, hidden] fp32 tensor back to back (the median of 200 after 20
warm-ups), with nothing else to wait for.

    python benchmarks/parallel/tensor_parallel.py --out benchmarks/parallel/results/tensor_parallel.json
    python benchmarks/parallel/tensor_parallel.py --pp-sizes 2 --out benchmarks/parallel/results/pipeline_parallel.json
    python benchmarks/parallel/tensor_parallel.py --tp-sizes '' --pp-sizes 2 --pp-micro-batches 2,1 \
        --allreduce-rows '' --out benchmarks/parallel/results/pipeline_micro_batches.json
    # a multi-GPU machine (NCCL, one GPU per rank):
    python benchmarks/parallel/tensor_parallel.py --device cuda --tp-sizes 1,2,4 --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common

RANK_LINE = re.compile(
    r"tensor-parallel rank (\d+): (\d+) forward steps, ([0-9.]+) s in collectives"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--pp-sizes", default="", help="pipeline sizes to run at TP=1, e.g. 2")
    p.add_argument(
        "--pp-micro-batches",
        default="",
        help="steps in flight to compare at each pipeline size, e.g. 2,1 (default: "
        "one run at pipeline_parallel_size)",
    )
    common.add_offline_args(p)
    p.add_argument("--allreduce-rows", default="1,32,128", help="'' to skip")
    p.add_argument("--hidden", type=int, default=common.MODEL_SPEC["hidden_size"])
    p.add_argument("--child-pp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--child-micro", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--allreduce-child", default=None, help=argparse.SUPPRESS)  # rank,port
    return p.parse_args(argv)


class InFlightProbe:
    """``run_offline``'s probe: its first call (before the timed run) starts a thread that
    counts the engine core's steps in flight every 2 ms; its second stops it. -> the sends by
    depth (``EngineCore.batch_queue_depths``) then, and the samples per number in flight."""

    def __init__(self) -> None:
        self.samples: Counter[int] = Counter()
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def __call__(self, llm: Any) -> dict[str, Any]:
        core = llm.engine.cores[0]
        if self.thread is None:
            self.thread = threading.Thread(target=self._sample, args=(core,), daemon=True)
            self.thread.start()
        else:
            self.done.set()
            self.thread.join()
        return {"sends": dict(core.batch_queue.depths), "samples": dict(self.samples)}

    def _sample(self, core: Any) -> None:  # the engine core runs in the LLM's own thread
        while not self.done.wait(0.002):
            self.samples[core.num_in_flight] += 1


def run_child(args: argparse.Namespace) -> None:
    """One LLM at tensor_parallel_size ``args.child``; prints a JSON line on stdout."""
    if args.child_micro:
        os.environ["TRILLM_PP_MICRO_BATCHES"] = str(args.child_micro)
    probe = InFlightProbe() if args.child_pp > 1 else None
    result = common.run_offline(
        args, "1GiB", probe, tensor_parallel_size=args.child, pipeline_parallel_size=args.child_pp
    )
    before, after = result.pop("probe")
    if after is not None:
        total = sum(after["samples"].values()) or 1
        result["in_flight_time_share"] = {
            str(k): round(v / total, 3) for k, v in sorted(after["samples"].items())
        }
        sends = Counter(after["sends"]) - Counter(before["sends"])
        result["sends_by_depth"] = {str(k): v for k, v in sorted(sends.items())}
    print(json.dumps(result), flush=True)


def allreduce_child(args: argparse.Namespace) -> None:
    """One of two ranks timing all-reduces; rank 0 prints {rows: median seconds}."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, port = (int(x) for x in args.allreduce_child.split(","))
    backend = "nccl" if args.device == "cuda" else "gloo"
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    medians = {}
    for rows in (int(r) for r in args.allreduce_rows.split(",")):
        t = torch.ones(rows, args.hidden, device=device)  # [rows, hidden] fp32
        times = []
        for i in range(220):
            start = time.perf_counter()
            dist.all_reduce(t)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 20:
                times.append(time.perf_counter() - start)
        medians[rows] = sorted(times)[len(times) // 2]
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(medians), flush=True)


def measure_allreduce(args: argparse.Namespace) -> dict[str, float]:
    port = common.free_port()
    env = {**os.environ, "PYTHONPATH": str(common.REPO_ROOT)}
    base = [
        sys.executable,
        __file__,
        "--device",
        args.device,
        "--hidden",
        str(args.hidden),
        "--allreduce-rows",
        args.allreduce_rows,
        "--allreduce-child",
    ]
    procs = [
        subprocess.Popen([*base, f"{r},{port}"], stdout=subprocess.PIPE, text=True, env=env)
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("all-reduce timing failed")
    return {f"rows_{k}_us": 1e6 * v for k, v in json.loads(out[0].strip()).items()}


def measure(args: argparse.Namespace, tp: int, pp: int = 1, micro: int = 0) -> dict[str, Any]:
    extra = ["--child", str(tp), "--child-pp", str(pp), "--child-micro", str(micro)]
    result, stderr = common.run_offline_child(__file__, args, extra, f"TP={tp} PP={pp}")
    ranks = [(int(r), int(s), float(c)) for r, s, c in RANK_LINE.findall(stderr)]
    row: dict[str, Any] = {
        "tp": tp,
        "pp": pp,
        "micro_batches": micro or pp,
        "seconds": result["seconds"],
        "output_tok_s": result["output_tokens"] / result["seconds"],
    }
    for key in ("in_flight_time_share", "sends_by_depth"):
        if key in result:
            row[key] = result[key]
    if ranks:
        steps = max(s for _, s, _ in ranks)
        row["forward_steps"] = steps
        row["ms_per_step"] = 1e3 * result["seconds"] / steps
        for rank, _, comm in sorted(ranks):
            row[f"comm_ms_per_step_rank{rank}"] = 1e3 * comm / steps
    return row


def main() -> None:
    args = parse_args()
    if args.child is not None:
        run_child(args)
        return
    if args.allreduce_child is not None:
        allreduce_child(args)
        return
    args.model = args.model or str(common.build_bench_model())
    micros = [int(m) for m in args.pp_micro_batches.split(",") if m] or [0]
    sizes = [(int(s), 1, 0) for s in args.tp_sizes.split(",") if s]
    sizes += [(1, int(s), m) for s in args.pp_sizes.split(",") if s for m in micros]
    machine = common.machine_info()
    rows = common.run_rounds(args.rounds, sizes, lambda size: measure(args, *size))
    columns = [
        ("round", "d"),
        ("tp", "d"),
        ("pp", "d"),
        ("micro_batches", "d"),
        ("seconds", ".2f"),
        ("output_tok_s", ".1f"),
        ("forward_steps", "d"),
        ("ms_per_step", ".2f"),
        ("comm_ms_per_step_rank0", ".2f"),
        ("comm_ms_per_step_rank1", ".2f"),
    ]
    if rows:
        common.print_table(rows, columns)
    allreduce = measure_allreduce(args) if args.allreduce_rows else {}
    print("all-reduce alone (median):", json.dumps(allreduce))
    command = "python benchmarks/parallel/tensor_parallel.py " + " ".join(sys.argv[1:])
    common.write_json(
        args.out,
        {
            "machine": machine,
            "command": command,
            "args": vars(args) | {"out": None},
            "rows": rows,
            "allreduce_alone": allreduce,
        },
    )


if __name__ == "__main__":
    main()
