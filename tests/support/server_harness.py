"""A real ``trillm serve`` subprocess for the server tests (test_server_*.py)."""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import httpx
from serve_zygote import Zygote, ZygoteChild

from trillm import envs

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Each xdist worker draws the ports its servers listen on from its own block below the
# kernel's ephemeral range: a port picked here is closed again before the server binds it,
# and in that gap the kernel could hand an ephemeral port to any connection on the machine
# (another test's client, a tensor-parallel group's sockets) but never one of these.
# A process starts at a random place in its block: pytest sessions run side by side without
# xdist (each its worker "gw0") then rarely try the same port in the same second.
_PORTS_PER_WORKER = 400
_next_port = [random.randrange(_PORTS_PER_WORKER)]


def free_port() -> int:
    """A loopback port free now, from this xdist worker's block below the ephemeral range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    first = max(1024, _ephemeral_start() - _PORTS_PER_WORKER * (index % 16 + 1))
    for _ in range(_PORTS_PER_WORKER):
        port = first + _next_port[0] % _PORTS_PER_WORKER
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the whole block taken: any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env() -> dict[str, str]:
    """The environment a server starts with: this process's, the checkout importable (less
    the name of the test running, which pytest keeps in it)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    # This process's rank zygote server cannot fork a server's ranks (it does not descend from
    # the server); a multi-rank server forked from the serve zygote gets one of its own.
    env.pop(envs.RANK_ZYGOTE.name, None)
    return env


# The session's environment, as the test modules found it (before any test changed it): a
# server asked for in it, or in it with other values of variables that trillm reads only when
# it needs them (trillm/envs.py), is forked from the zygote; one in another environment (say,
# TRILLM_NO_EXTENSIONS, read once at import) is started afresh, since a module the zygote
# imported may have read it.
_SESSION_ENV = server_env()
_READ_WHEN_NEEDED = {
    name
    for var in vars(envs).values()
    if isinstance(var, envs.EnvVar) and var is not envs.NO_EXTENSIONS
    for name in var.names
} | {"TORCHINDUCTOR_CACHE_DIR"}  # torch sets it in the test's process (for its subprocesses)


def env_changes(env: dict[str, str]) -> set[str]:
    """The variables ``env`` sets otherwise than the session did."""
    return {k for k in env.keys() | _SESSION_ENV.keys() if env.get(k) != _SESSION_ENV.get(k)}


# What Ray writes into the process's environment (RAY_CLIENT_MODE on import; RAY_USAGE_STATS_
# ENABLED, RAY_AUTH_MODE, PYTHONBREAKPOINT on ray.init). The zygote never imports Ray and a
# forked server runs with the environment it is given, so it reads them as a fresh one would.
_RAY_PREFIX = "RAY_"
_SET_BY_RAY = {"PYTHONBREAKPOINT"}


def _forkable(env: dict[str, str]) -> bool:
    return all(
        name in _READ_WHEN_NEEDED or name in _SET_BY_RAY or name.startswith(_RAY_PREFIX)
        for name in env_changes(env)
    )


_ZYGOTE: list[Zygote] = []


def _zygote() -> Zygote:
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote(REPO, _SESSION_ENV))
        atexit.register(_ZYGOTE[0].close)
    return _ZYGOTE[0]


class ServerProcess:
    """``trillm serve ARGS`` on 127.0.0.1:<free port>; ``start()`` waits for /health 200."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        api_key: str | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        # ``launcher``: how the program is started (default ``python -m trillm``, forked from
        # this worker's zygote where the environment is the session's: serve_zygote.py).
        self.launcher = launcher
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.api_key = api_key
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        if api_key:
            self.args += ["--api-key", api_key]
        self.log_path = log_path
        self.proc: subprocess.Popen | ZygoteChild | None = None

    def start(self, timeout: float = 300.0) -> ServerProcess:
        env = server_env()
        if self.launcher is None and _forkable(env):
            self.proc = _zygote().spawn(["serve", *self.args], env, self.log_path)
        else:
            # The child writes the log through its own descriptor; this process keeps none.
            launcher = self.launcher or [sys.executable, "-m", "trillm"]
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [*launcher, "serve", *self.args],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"trillm serve exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.proc.kill()
        self.proc.wait()
        raise TimeoutError(f"trillm serve not healthy after {timeout} s:\n{self.log()}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.terminate()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return code


def run_trillm(
    args: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float = 300.0
) -> SimpleNamespace:
    """``python -m trillm ARGS`` run to its end with no stdin: ``returncode`` and ``output``
    (stdout and stderr together, kept in ``log_path``). Forked from this worker's zygote where
    the environment allows (as ``ServerProcess``), so a command does not import torch and
    transformers again; otherwise a process of its own."""
    env = server_env() if env is None else env
    proc: subprocess.Popen | ZygoteChild
    if _forkable(env):
        proc = _zygote().spawn(args, env, log_path)
    else:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trillm", *args],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return SimpleNamespace(returncode=code, output=log_path.read_text(errors="replace"))


def metric_value(text: str, name: str) -> float:
    """The sum of the samples of ``name`` (any labels) in a Prometheus text page."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


# The sockets open_request has handed out; the test's teardown closes those it left open.
_OPEN_REQUESTS: list[socket.socket] = []


def close_open_requests() -> None:
    while _OPEN_REQUESTS:
        _OPEN_REQUESTS.pop().close()


def open_request(srv: ServerProcess, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket and return the socket, unread (the client can leave; the
    socket is closed when the test ends)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    _OPEN_REQUESTS.append(sock)
    sock.sendall(head.encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    """Read a raw socket until ``marker`` arrives (fails if the server closes first)."""
    seen = b""
    while marker not in seen:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before {marker!r}: {seen[-300:]!r}"
        seen += chunk
    return seen


def gauges(srv: ServerProcess) -> tuple[float, float]:
    """(running, waiting) requests from the server's /metrics."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    running, waiting = (
        metric_value(text, f"trillm:num_requests_{name}") for name in ("running", "waiting")
    )
    return running, waiting


def wait_gauges(srv: ServerProcess, expected: tuple[float, float], within: float = 20) -> None:
    deadline = time.monotonic() + within
    while (now := gauges(srv)) != expected:
        assert time.monotonic() < deadline, f"gauges {now}, expected {expected}"
        time.sleep(0.05)


def rss_mib(pid: int) -> float:
    """A process's resident memory (VmRSS), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def worker_pids(pid: int) -> list[int]:
    """The model-worker processes among ``pid``'s children."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            if b"worker_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(int(child))
    return out


def run_polling_health(
    srv: ServerProcess,
    work: Callable[[], T],
    each_poll: Callable[[], None] | None = None,
    interval: float = 0.02,
) -> tuple[T, float, float]:
    """``work()`` on a thread while ``/health`` is polled: (its result, its seconds, the
    slowest ``/health``). Each poll is a new connection (a kept-alive one could time out while
    the event loop is held); ``each_poll`` runs after each (to sample memory, say). An error of
    ``work`` is raised here."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    worst = 0.0
    while thread.is_alive():
        polled = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=300).status_code == 200
        worst = max(worst, time.monotonic() - polled)
        if each_poll is not None:
            each_poll()
        time.sleep(interval)
    thread.join()
    took = time.monotonic() - start
    if errors:
        raise errors[0]
    return result[0], took, worst


def post_polling_health(
    srv: ServerProcess, path: str, body: dict, each_poll: Callable[[], None] | None = None
) -> tuple[httpx.Response, float, float]:
    """POST ``body`` to ``path`` while ``/health`` is polled: (answer, its seconds, the slowest
    ``/health``)."""

    def post() -> tuple[httpx.Response, float]:
        start = time.monotonic()
        answer = httpx.post(srv.url + path, json=body, timeout=300)
        return answer, time.monotonic() - start

    (answer, took), _, worst = run_polling_health(srv, post, each_poll)
    return answer, took, worst


def stats_engine(per_core: list) -> SimpleNamespace:
    """A stand-in engine for the metrics and stats-line units: what they read of an
    ``AsyncEngine`` (each core's ``SchedulerStats`` given), the rest at ordinary values."""
    from trillm.engine.dp_router import sum_stats

    cache = SimpleNamespace(
        block_size=16,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.9,
        num_gpu_blocks_override=None,
        kv_cache_memory=1 << 30,
    )
    return SimpleNamespace(
        get_stats=lambda: per_core[0] if len(per_core) == 1 else sum_stats(per_core),
        get_engine_stats=lambda: list(per_core),
        data_parallel_size=len(per_core),
        model_config=SimpleNamespace(max_model_len=2048),
        config=SimpleNamespace(
            lora=None, cache=cache, scheduler=SimpleNamespace(max_num_batched_tokens=8192)
        ),
        executors=[SimpleNamespace(num_blocks=64) for _ in per_core],
        step_observers=[],
        preprocessor=SimpleNamespace(multimodal=SimpleNamespace(cache=None)),  # text-only
    )


def fake_llama_args(model: str, *more: str) -> list[str]:
    """``trillm serve`` flags of a fake-runner server over a tiny Llama folder (its tokenizer and
    config; no forward pass): a 2,048-token context and a 256 MiB KV cache, then ``more``."""
    return [
        model,
        "--runner",
        "trillm.worker.fake_runner:FakeModelRunner",
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "256MiB",
        *more,
    ]
