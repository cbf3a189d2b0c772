"""benchmarks/peers/peers_1b.py's servers: each kind's command line (trillm, vLLM's CPU build,
llama.cpp's llama-server) at the same KV budget and context, started in a session of its own
and waited for until healthy, stopped with its whole process group, and the memory its
session holds."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.peers.peers_1b_shapes import kv_bytes_per_token, say


def server_cmd(name: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    hf = args.root / args.shape
    env = dict(os.environ)
    kind, fmt = name.split("-", 1)
    gguf = args.root / f"{args.shape}-{fmt.removeprefix('gguf-')}.gguf"
    port = str(args.port)
    # what trillm and vLLM's OpenAI server are told alike
    served = ["--host", "127.0.0.1", "--port", port, "--served-model-name", args.served]
    served += ["--max-model-len", str(args.max_model_len)]
    if kind == "trillm":
        model = (
            [str(hf), "--dtype", getattr(args, "hf_dtype", "bfloat16")]
            if fmt == "bf16"
            else [str(gguf), "--tokenizer", str(hf), "--dtype", args.trillm_gguf_dtype]
        )
        cmd = [
            args.trillm,
            "serve",
            *model,
            *served,
            "--kv-cache-memory",
            f"{args.kv_gib}GiB",
            *args.trillm_extra.split(),
        ]
    elif kind == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
        env.update(kv.split("=", 1) for kv in args.vllm_env.split())  # type: ignore[misc]
        cmd = [
            str(args.peer / "vllm-venv/bin/python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(hf),
            "--dtype",
            "bfloat16",
            *served,
        ]
    elif kind == "llama":
        # one unified KV cache of the same budget (f16 K and V) over the slots: a slot may take
        # up to the whole context, as a paged cache lets one request do
        ctx = args.kv_gib * 2**30 // kv_bytes_per_token(args.shape)
        cmd = [
            str(args.peer / "llama.cpp/build/bin/llama-server"),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "-t",
            str(args.threads),
            "-tb",
            str(args.threads),
            "--parallel",
            str(args.slots),
            "-c",
            str(ctx),
            "--kv-unified",
            "--cont-batching",
            "--alias",
            args.served,
            "--no-webui",
        ]
    else:
        raise SystemExit(f"unknown server {name}")
    return cmd, env


def healthy(base: str) -> bool:
    try:
        return all(
            httpx.get(base + p, timeout=5).status_code == 200 for p in ("/health", "/v1/models")
        )
    except httpx.HTTPError:
        return False


def start(name: str, args: argparse.Namespace, out: Path) -> subprocess.Popen[bytes]:
    cmd, env = server_cmd(name, args)
    say(f"start {name}: {' '.join(cmd)}")
    log = open(out / f"{name}.server.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        cmd,
        cwd=out,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    t0 = time.time()
    while not healthy(args.base):
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited during start-up (see {name}.server.log)")
        if time.time() - t0 > args.startup_timeout:
            stop(proc)
            raise RuntimeError(f"{name} not healthy after {args.startup_timeout} s")
        time.sleep(1)
    say(f"{name} healthy after {time.time() - t0:.0f} s")
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Its own session: the group holds only what this script started (API process, workers)."""
    for sig, wait in ((signal.SIGTERM, 40), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


def session_pss_gib(sid: int) -> float:
    """The proportional set size of every process in the server's session (API process,
    engine, workers; shared pages counted once), GiB."""
    total = 0
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            if d.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                for line in (d / "smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total / 2**30
