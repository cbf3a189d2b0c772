"""How long ``trillm serve`` takes to start and to stop, per parallel layout.

For each layout (``uni``: one worker; ``tp2``; ``pp2``; ``tp2xpp2``) and round: start
``python -m trillm serve MODEL`` on a free loopback port, poll ``/health`` every 50 ms until it
answers 200 (*ready*), send one greedy /v1/completions request of two prompts x 8 tokens
(*first request*), then SIGTERM and wait for the process to exit (*stop*). Reported: the
median of the rounds, per layout, with *cpu*: the CPU seconds of the server and every process
it waited for (its ranks), from start to exit. ``--worker-start zygote spawn`` runs each round
under each ``TRILLM_WORKER_START`` in turn (alternated), a row per (layout, mode). ``--model`` defaults to a tiny random Qwen2 (2 layers, the
parallelism tests' shape) built once under ``--cache``; the numbers are wall seconds on
whatever else the machine is doing, so compare layouts or trees in one run.

    python benchmarks/serving/serve_startup.py [--model PATH] [--layouts uni tp2 pp2 tp2xpp2]
        [--rounds 3] [--worker-start zygote spawn] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

LAYOUTS = {"uni": [], "tp2": ["-tp", "2"], "pp2": ["-pp", "2"], "tp2xpp2": ["-tp", "2", "-pp", "2"]}
LIMITS = ["--max-model-len", "256", "--kv-cache-memory", "16MiB"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_round(model: str, flags: list[str], worker_start: str | None) -> dict[str, float]:
    port = free_port()
    env = dict(os.environ)
    if worker_start is not None:
        env["TRILLM_WORKER_START"] = worker_start
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "trillm",
        "serve",
        model,
        *flags,
        *LIMITS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cpu0, start = children_cpu_s(), time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"trillm serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.monotonic()
        body = {
            "prompt": ["Hello there, how", "The capital of France is"],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        answered = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        stopped = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {
        "ready_s": ready - start,
        "first_request_s": answered - ready,
        "stop_s": stopped - answered,
        "cpu_s": children_cpu_s() - cpu0,
    }


def tiny_model(cache: Path) -> str:
    folder = cache / "serve-startup-qwen2"
    if not (folder / "config.json").is_file():
        from trillm.testing.tiny_models import build_tiny_model

        build_tiny_model("qwen2", folder, num_hidden_layers=2)
    return str(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "trillm-bench")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--worker-start",
        nargs="+",
        default=[None],
        choices=["zygote", "spawn"],
        help="TRILLM_WORKER_START per round, alternated (default: unset)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = args.model or tiny_model(args.cache)
    rows: dict[str, dict[str, object]] = {}
    for layout in args.layouts:
        runs: dict[str | None, list[dict[str, float]]] = {mode: [] for mode in args.worker_start}
        for _ in range(args.rounds):
            for mode in args.worker_start:
                runs[mode].append(one_round(model, LAYOUTS[layout], mode))
        for mode, rounds in runs.items():
            name = layout if mode is None else f"{layout}/{mode}"
            med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            rows[name] = {**med, "rounds": rounds}
            print(
                f"{name:15s} ready {med['ready_s']:6.2f} s  first request "
                f"{med['first_request_s']:5.2f} s  stop {med['stop_s']:5.2f} s  "
                f"cpu {med['cpu_s']:6.2f} s",
                flush=True,
            )
    if args.out is not None:
        load = os.getloadavg()[0]
        args.out.write_text(
            json.dumps({"model": model, "load_1min": load, "layouts": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
