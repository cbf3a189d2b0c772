"""Where a served concurrency-16 run's CPU goes, by process: ``trillm serve`` on SmolLM2-135M
(the peer kit's Q4_1 GGUF kept quantized, or its folder in bfloat16), ``trillm bench serve``
sending ``--num-prompts`` random 256-token prompts, 128 outputs each, greedy, ``ignore_eos``,
16 at a time (the peers workload, /work/shared/peers/run_compare.sh; after an untimed warm-up
wave of other prompts). For the timed run: the wall clock, output tok/s and mean TTFT / TPOT;
the CPU seconds (utime + stime from /proc) of the API server process (HTTP, SSE, the engine
core: scheduler, detokenizer, output handler), of the model worker (forward, sampling), and of
the client; the machine's busy share (/proc/stat); and each as CPU ms per output token.

On a 2-core machine the three share the cores: throughput = output tokens / wall, and the wall
is at least (the CPU of all three + the machine's other work) / 2. The split says which part
to cut. Run it from the tree to measure (the server starts from this file's repository).

    python benchmarks/serving/c16_served_cpu.py [--model q4_1|bf16] [--num-prompts 64] [--rounds 1]
        [--extra "--kv-cache-dtype bfloat16"] [--concurrency 16 1] [--jsonl results.jsonl]

``--extra`` adds serve flags (e.g. a dtype to compare, each in its own run: alternate them);
``--concurrency 16 1`` also measures the batch-1 latency workload (``--c1-prompts`` prompts) on
the same server, after each round's c16 run; ``--jsonl`` appends one
line a round (the model, flags, concurrency and every figure printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*

from benchmarks.common import REPO_ROOT, run_bench_serve, trillm_server  # noqa: E402

PEER = Path(os.environ.get("TRILLM_PEER_DIR", "~/.cache/trillm-peer")).expanduser()
MODELS = {
    "q4_1": (PEER / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf", []),
    "bf16": (PEER / "smollm2-135m-instruct", ["--dtype", "bfloat16"]),
}
HZ = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    """root and its descendants' pids."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _cpu(pid: int) -> float:
    """A process's CPU seconds (utime + stime, its threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / HZ


def _role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    return "worker" if b"trillm.worker.worker_main" in cmd else "api"


def _machine() -> tuple[int, int]:
    """(all, idle) jiffies of /proc/stat's cpu line."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(v), v[3] + v[4]


def _bench_args(num_prompts: int, seed: int, tokenizer: str, concurrency: int = 16) -> list[str]:
    return [
        "--backend", "openai", "--endpoint", "/v1/completions", "--model", "smollm2",
        "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", "256",
        "--random-output-len", "128", "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
        "--temperature", "0", "--seed", str(seed), "--save-result",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="q4_1")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--extra", default="", help="more serve flags, one string")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument(
        "--c1-prompts", type=int, default=8, help="prompts of a --concurrency 1 run"
    )
    parser.add_argument("--jsonl", type=Path, default=None)
    args = parser.parse_args()
    model, flags = MODELS[args.model]
    flags = [*flags, *shlex.split(args.extra)]
    tokenizer = str(PEER / "smollm2-135m-instruct")
    out_dir = Path("/tmp") / f"c16_served_cpu_{os.getpid()}"
    out_dir.mkdir(exist_ok=True)
    print(
        f"trillm at {REPO_ROOT}, model {args.model} {' '.join(flags)}, load "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    with trillm_server(str(model), ["--served-model-name", "smollm2", *flags]) as (url, proc):
        run_bench_serve(url, _bench_args(16, 1000, tokenizer), out_dir / "warm.json")
        for r in range(args.rounds):
            for c in args.concurrency:
                n = args.num_prompts if c > 1 else args.c1_prompts
                bench = _bench_args(n, r + (100 if c == 1 else 0), tokenizer, c)
                row = _measure(url, proc.pid, bench, out_dir / f"r{r}_c{c}.json")
                row = {"model": args.model, "flags": flags, "concurrency": c, "round": r, **row}
                if args.jsonl:
                    with args.jsonl.open("a") as f:
                        f.write(json.dumps(row) + "\n")


def _measure(url: str, server_pid: int, bench: list[str], result: Path) -> dict[str, float]:
    """One timed ``trillm bench serve`` run: its figures and each process's CPU, printed."""
    pids = _tree(server_pid)
    before = {pid: _cpu(pid) for pid in pids}
    machine0, t0, client0 = _machine(), time.monotonic(), os.times()
    res = run_bench_serve(url, bench, result)
    machine1, wall, client1 = _machine(), time.monotonic() - t0, os.times()
    spent = {"api": 0.0, "worker": 0.0}
    for pid in pids:
        spent[_role(pid)] = spent.get(_role(pid), 0.0) + _cpu(pid) - before[pid]
    spent["client"] = (client1.children_user + client1.children_system) - (
        client0.children_user + client0.children_system
    )
    total, idle = machine1[0] - machine0[0], machine1[1] - machine0[1]
    tokens = res["total_output_tokens"]
    c = bench[bench.index("--max-concurrency") + 1]
    print(
        f"c{c}: {tokens} tokens, out {res['output_throughput']:.1f} tok/s, TTFT mean "
        f"{res['mean_ttft_ms']:.0f} ms, TPOT mean {res['mean_tpot_ms']:.1f} ms; machine "
        f"busy {100 * (total - idle) / max(total, 1):.0f}%, 1-min load {os.getloadavg()[0]:.2f}"
    )
    for role in ("worker", "api", "client"):
        print(
            f"  {role:6s} {spent[role]:7.2f} CPU s  {1e3 * spent[role] / tokens:6.3f} ms a "
            f"token  {spent[role] / wall:5.2f} cores"
        )
    return {
        "tokens": tokens, "wall_s": wall, "output_throughput": res["output_throughput"],
        "mean_ttft_ms": res["mean_ttft_ms"], "mean_tpot_ms": res["mean_tpot_ms"],
        "busy": (total - idle) / max(total, 1), "load1": os.getloadavg()[0],
        **{f"{role}_cpu_ms_per_token": 1e3 * spent[role] / tokens for role in spent},
    }  # fmt: skip


if __name__ == "__main__":
    main()
