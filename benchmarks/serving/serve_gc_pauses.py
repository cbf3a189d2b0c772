"""The API server's garbage-collection pauses under load, with and without the frozen startup
heap (trillm/gc_heap.py).

For each arm, in turn: start ``trillm serve MODEL`` in a Python process that records every
oldest-generation (gen 2) collection through ``gc.callbacks`` (its duration and the objects it
walked); once ``/health`` answers, run ``trillm bench serve`` (random prompts, greedy, a fixed
concurrency); then stop the server. The ``no-freeze`` arm replaces the API server's call of
``freeze_startup_heap`` by a no-op (the model workers, separate processes, freeze in both arms).
Reported per arm: the gen-2 collections while the load ran, their longest and mean pause, and
the bench's request rate, P99 TTFT and TPOT. ``--model`` defaults to benchmarks/serving/serve_startup.py's
tiny Qwen2, whose engine is fast enough that the frontend's pauses show.

    python benchmarks/serving/serve_gc_pauses.py [--model PATH] [--num-prompts 1500]
        [--max-concurrency 32] [--rounds 1] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks.serving.serve_startup import free_port, tiny_model

# Runs the CLI in this interpreter with a gen-2 probe; "0"/"1": whether the API server freezes.
SERVER = """
import gc, sys, time
start = {}
def probe(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        start["t"] = time.perf_counter()
    else:
        ms = (time.perf_counter() - start["t"]) * 1000
        sys.stderr.write(f"GC2 {time.time():.3f} {ms:.2f} {info['collected']}\\n")
gc.callbacks.append(probe)
if sys.argv[1] == "0":
    import trillm.entrypoints.openai.api_server as api_server
    api_server.freeze_startup_heap = lambda process: 0
from trillm.entrypoints.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

BENCH_KEYS = {
    "Request throughput (req/s):": "req_s",
    "P99 TTFT (ms):": "p99_ttft_ms",
    "Mean TPOT (ms):": "mean_tpot_ms",
    "P99 TPOT (ms):": "p99_tpot_ms",
}


def one_arm(model: str, freeze: bool, args: argparse.Namespace) -> dict[str, float | int]:
    port = free_port()
    log = Path(f"/tmp/serve_gc_pauses_{port}.log")
    argv = [
        sys.executable,
        "-c",
        SERVER,
        "1" if freeze else "0",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "64MiB",
    ]
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("the server did not start")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return run_load(proc, port, log, model, args)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def run_load(
    proc: subprocess.Popen[bytes], port: int, log: Path, model: str, args: argparse.Namespace
) -> dict[str, float | int]:
    try:
        began = time.time()
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "trillm",
                "bench",
                "serve",
                "--port",
                str(port),
                "--model",
                model,
                "--num-prompts",
                str(args.num_prompts),
                "--random-input-len",
                "32",
                "--random-output-len",
                "8",
                "--max-concurrency",
                str(args.max_concurrency),
                "--disable-tqdm",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        ended = time.time()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    pauses = [
        float(line.split()[2])
        for line in log.read_text().splitlines()
        if line.startswith("GC2 ") and began <= float(line.split()[1]) <= ended
    ]
    row: dict[str, float | int] = {
        "gen2_collections": len(pauses),
        "max_pause_ms": max(pauses, default=0.0),
        "mean_pause_ms": statistics.fmean(pauses) if pauses else 0.0,
    }
    for line in bench.stdout.splitlines():
        for label, key in BENCH_KEYS.items():
            if line.startswith(label):
                row[key] = float(line.split()[-1])
    log.unlink()
    return row


def _cell(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "trillm-bench")
    p.add_argument("--num-prompts", type=int, default=1500)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = args.model or tiny_model(args.cache)
    rows = []
    for r in range(args.rounds):
        for freeze in (False, True):
            row = {
                "round": r,
                "arm": "freeze" if freeze else "no-freeze",
                **one_arm(model, freeze, args),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = [
        "arm",
        "gen2_collections",
        "max_pause_ms",
        "mean_pause_ms",
        "req_s",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
    ]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(_cell(row.get(c)) for c in cols) + " |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
