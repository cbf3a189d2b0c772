"""Frontend headroom: HTTP streaming throughput with a near-zero-cost model (FakeModelRunner).

``trillm serve --runner trillm.worker.fake_runner:FakeModelRunner`` (the model costs nothing,
so everything measured is the server: HTTP, SSE, JSON, detokenization, output processing,
scheduling, IPC) against ``python -m trillm.bench serve --max-concurrency 256``. Reports
tokens delivered to clients per second and TTFT, plus the CPU seconds the server (with its
worker) and the client each used, since both share this machine's cores. With ``--profile``
a second run is recorded with py-spy (server process and its worker) and the top functions
by self and inclusive time are printed.

    python benchmarks/serving/frontend_headroom.py --profile --out benchmarks/serving/results/frontend_headroom.json
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common

FAKE_RUNNER = "trillm.worker.fake_runner:FakeModelRunner"
TOP_N = 25


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="one more run under py-spy")
    p.add_argument("--profile-rate", type=int, default=200, help="py-spy samples/s")
    p.add_argument("--serve-args", nargs="*", default=[], help="extra trillm serve flags")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def serve_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--runner",
        FAKE_RUNNER,
        "--max-num-seqs",
        str(args.concurrency),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        *args.serve_args,
    ]


def bench_flags(args: argparse.Namespace, num_prompts: int) -> list[str]:
    return [
        "--dataset-name",
        "random",
        "--num-prompts",
        str(num_prompts),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--max-concurrency",
        str(args.concurrency),
        "--ignore-eos",
        "--metric-percentiles",
        "50,99",
    ]


# ---------------------------------------------------------------- CPU accounting


def _proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def tree_cpu_s(pid: int) -> float:
    return _proc_cpu_s(pid) + sum(tree_cpu_s(c) for c in _children(pid))


def children_rusage_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ---------------------------------------------------------------- runs


def measured_run(url: str, server_pid: int, args: argparse.Namespace, tmp: Path) -> dict:
    server0, client0, t0 = tree_cpu_s(server_pid), children_rusage_s(), time.perf_counter()
    record = common.run_bench_serve(
        url, bench_flags(args, args.num_prompts), tmp / f"run-{time.monotonic_ns()}.json"
    )
    wall = time.perf_counter() - t0
    server_cpu = tree_cpu_s(server_pid) - server0
    client_cpu = children_rusage_s() - client0
    if record["failed"]:
        raise RuntimeError(f"{record['failed']} request(s) failed")
    return dict(
        tok_s=record["output_throughput"],
        duration_s=record["duration"],
        output_tokens=record["total_output_tokens"],
        mean_ttft_ms=record["mean_ttft_ms"],
        p50_ttft_ms=record.get("p50_ttft_ms"),
        p99_ttft_ms=record.get("p99_ttft_ms"),
        mean_itl_ms=record.get("mean_itl_ms"),
        p99_itl_ms=record.get("p99_itl_ms"),
        mean_tpot_ms=record.get("mean_tpot_ms"),
        server_cpu_s=server_cpu,
        client_cpu_s=client_cpu,  # includes the client's start-up and test request
        wall_s=wall,
    )


def profiled_run(url: str, server_pid: int, args: argparse.Namespace, tmp: Path) -> dict:
    """py-spy records the server (and its worker) for the length of one bench run."""
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    raw = tmp / "server-profile.txt"
    spy = subprocess.Popen(
        [
            pyspy,
            "record",
            "--pid",
            str(server_pid),
            "--subprocesses",
            "--nonblocking",
            "--rate",
            str(args.profile_rate),
            "--format",
            "raw",
            "--output",
            str(raw),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)
    try:
        run = measured_run(url, server_pid, args, tmp)
    finally:
        spy.send_signal(2)  # SIGINT: py-spy writes the profile and exits
        spy.wait(timeout=60)
    return dict(run=run, **summarize_profile(raw))


def _frame_name(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (file.py)': lines merged per function."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 1)[-1] if where else ""
    return f"{name} ({file})" if file else name


def summarize_profile(raw: Path) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    self_counts: collections.Counter[str] = collections.Counter()
    incl_counts: collections.Counter[str] = collections.Counter()
    process_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        procs = [f for f in frames if f.startswith("process ")]
        process_counts[procs[-1][:100] if procs else "?"] += n
        names = [_frame_name(f) for f in frames if not f.startswith(("process ", "thread "))]
        names = names or ["(no Python frame)"]
        self_counts[names[-1]] += n
        for name in set(names):
            incl_counts[name] += n

    def top(counter: collections.Counter[str]) -> list[dict[str, Any]]:
        return [dict(function=k, share=v / total) for k, v in counter.most_common(TOP_N)]

    return dict(
        samples=total,
        top_self=top(self_counts),
        top_inclusive=top(incl_counts),
        processes=top(process_counts),
    )


def print_profile(prof: dict[str, Any]) -> None:
    print(f"\npy-spy, server + worker, {prof['samples']} samples (idle excluded):")
    for title in ("top_self", "top_inclusive", "processes"):
        print(f"  {title}:")
        for row in prof[title][:TOP_N]:
            print(f"    {row['share']:6.1%}  {row['function']}")


def main() -> None:
    args = parse_args()
    folder = common.build_bench_model()  # the fake runner only reads its config.json
    machine = common.machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="frontend-headroom-"))
    runs, profile = [], None
    with common.trillm_server(str(folder), serve_flags(args), log_path=tmp / "server.log") as (
        url,
        proc,
    ):
        common.run_bench_serve(url, bench_flags(args, 32), tmp / "warmup.json")
        for r in range(args.rounds):
            runs.append(measured_run(url, proc.pid, args, tmp))
            print(
                f"round {r}: {runs[-1]['tok_s']:.0f} tok/s, "
                f"p99 TTFT {runs[-1]['p99_ttft_ms']:.0f} ms",
                flush=True,
            )
        if args.profile:
            profile = profiled_run(url, proc.pid, args, tmp)
    print(
        f"\nfrontend headroom: fake model, {args.concurrency} concurrent streams, "
        f"{args.num_prompts} requests x {args.output_len} tokens "
        f"({machine['cpu']}, {machine['cpus']} CPUs, load {machine['load_avg_1m']:.1f})"
    )
    rows = runs + ([dict(profile["run"], note="under py-spy")] if profile else [])
    common.print_table(
        rows,
        [
            ("tok_s", ".0f"),
            ("duration_s", ".2f"),
            ("mean_ttft_ms", ".0f"),
            ("p99_ttft_ms", ".0f"),
            ("mean_itl_ms", ".2f"),
            ("mean_tpot_ms", ".2f"),
            ("server_cpu_s", ".1f"),
            ("client_cpu_s", ".1f"),
        ],
    )
    if profile:
        print_profile(profile)
    common.write_json(
        args.out,
        dict(
            benchmark="frontend_headroom",
            machine=machine,
            args=vars(args) | {"out": str(args.out)},
            serve_flags=serve_flags(args),
            bench_flags=bench_flags(args, args.num_prompts),
            runs=runs,
            profile=profile,
        ),
    )


if __name__ == "__main__":
    main()
