"""Served tokens/s and where the CPU goes under each CPU thread binding (vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_NUM_OF_RESERVED_CPU``, trillm/distributed/cpu_binding.py).

For each setting in turn, each round in the same order (the machine is shared: settings are
compared within a round, as ratios to ``nobind``): start ``trillm serve`` on the benchmark
Llama (benchmarks/common.py) with the setting's variables, run ``trillm bench serve`` (random
prompts, ``--max-concurrency``), and read the CPU time (utime + stime, /proc/PID/stat) that
the API server process (the HTTP frontend and the engine core's Trio tasks: one process) and
the model worker spent during the run, as cores (CPU seconds / wall seconds). The settings:

- ``nobind``: nothing pinned, the worker's torch threads = the cores (trillm's default);
- ``auto``: the worker's threads pinned, one per usable core (one rank: no core reserved);
- ``auto-reserve1``: auto with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: the worker on all cores but
  the last, which is left to the API server;
- ``oversubscribed``: nobind with ``OMP_NUM_THREADS`` = 4 x the cores;
- ``nobind-fewer`` (not run by default): nobind with auto-reserve1's thread count, unpinned.

    python benchmarks/serving/cpu_binding_served.py [--rounds 3] [--num-prompts 96] [--settings ...]
        [--max-concurrency 16] [--out benchmarks/serving/results/cpu_binding.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*

from benchmarks.common import (
    build_bench_model,
    machine_info,
    print_table,
    run_bench_serve,
    trillm_server,
    write_json,
)

CORES = len(os.sched_getaffinity(0))
SETTINGS: dict[str, dict[str, str]] = {
    "nobind": {},
    "auto": {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
    "auto-reserve1": {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
    "oversubscribed": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(4 * CORES)},
    # auto-reserve1's thread count without its pinning: which of the two its speed is due to
    "nobind-fewer": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(CORES - 1)},
}
DEFAULT_SETTINGS = ("nobind", "auto", "auto-reserve1", "oversubscribed")
CLEARED = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of stat(5)


def worker_pids(server_pid: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        for child in Path(f"/proc/{server_pid}/task/{task}/children").read_text().split():
            if b"trillm.worker.worker_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
    return pids


def affinity(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_al"))


def run_setting(name: str, model: Path, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    saved = {k: os.environ.pop(k) for k in CLEARED if k in os.environ}
    os.environ.update(SETTINGS[name])
    log = out_dir / f"{name}.log"
    try:
        serve_args = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB"]
        with trillm_server(str(model), serve_args, log_path=log) as (url, proc):
            workers = worker_pids(proc.pid)
            load = os.getloadavg()[0]
            before = [cpu_seconds(p) for p in (proc.pid, *workers)]
            start = time.monotonic()
            record = run_bench_serve(url, bench_args(model, args), out_dir / f"{name}.json")
            wall = time.monotonic() - start
            after = [cpu_seconds(p) for p in (proc.pid, *workers)]
            pinned = affinity(workers[0])
    finally:
        for k in SETTINGS[name]:
            os.environ.pop(k, None)
        os.environ.update(saved)
    used = [(a - b) / wall for a, b in zip(after, before, strict=True)]
    rank_line = next((x for x in log.read_text().splitlines() if x.startswith("rank 0")), "")
    return {
        "setting": name,
        "env": SETTINGS[name],
        "load_1m_at_start": load,
        "output_tok_s": record["output_throughput"],
        "api_server_cores": used[0],
        "worker_cores": sum(used[1:]),
        "worker_affinity": pinned,
        "rank_says": rank_line,
        "wall_s": wall,
    }


def bench_args(model: Path, args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--seed",
        "0",
    ]


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: its tok/s over nobind's in the same round (median over rounds), the
    median cores each process used."""
    rows = []
    base = {r["round"]: r["output_tok_s"] for r in runs if r["setting"] == "nobind"}
    for name in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == name]
        ratios = [r["output_tok_s"] / base[r["round"]] for r in mine]
        rows.append(
            {
                "setting": name,
                "tok_s_median": statistics.median(r["output_tok_s"] for r in mine),
                "vs_nobind_median": statistics.median(ratios),
                "vs_nobind_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
                "api_cores": statistics.median(r["api_server_cores"] for r in mine),
                "worker_cores": statistics.median(r["worker_cores"] for r in mine),
                "rounds": len(mine),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=DEFAULT_SETTINGS)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/trillm-cpu-binding"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = build_bench_model()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_ in range(args.rounds):
        for name in args.settings:
            run = run_setting(name, model, args, args.work_dir)
            runs.append({"round": round_, **run})
            print(f"round {round_} {name}: {run['output_tok_s']:.1f} tok/s", flush=True)
    rows = summarise(runs)
    columns = [("setting", "s"), ("tok_s_median", ".1f"), ("vs_nobind_median", ".3f")]
    columns += [("vs_nobind_range", "s"), ("api_cores", ".2f"), ("worker_cores", ".2f")]
    print_table(rows, columns)
    command = "python benchmarks/serving/cpu_binding_served.py " + " ".join(sys.argv[1:])
    write_json(
        args.out,
        {"command": command, "machine": machine_info(), "summary": rows, "runs": runs},
    )


if __name__ == "__main__":
    main()
