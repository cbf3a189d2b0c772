"""``trillm serve`` processes forked from one that has already imported the server.

Every ``trillm serve`` a test starts spends seconds of CPU importing torch, transformers and
the server before it reads its flags; the suite starts about a hundred. A zygote (one per
pytest worker, started at its first server) imports them once, then forks a child per
server: the child takes the flags, the environment, the working directory and the log of the
server asked for, and runs ``trillm``'s ``main`` as ``python -m trillm serve ...`` would, so
the server itself (its HTTP listener, its engine, its worker processes) is the real one. The
zygote runs no model code and starts no threads before it forks (it asserts it has one).

The test side is ``Zygote.spawn(...) -> ZygoteChild``, whose ``pid``, ``poll``, ``wait``,
``send_signal``, ``terminate``, ``kill`` and ``returncode`` are ``subprocess.Popen``'s: the
zygote reaps its children and reports each exit status back over its stdout.

Run as a program (``python serve_zygote.py``, working directory the repository): reads one
JSON request per line on stdin, ``{"args", "env", "cwd", "log"}``, answers ``{"pid"}``, and
``{"exit": pid, "code": status}`` as each child ends; exits (killing its children) when stdin
closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# What ``trillm serve`` imports before it reads its flags (the costly part of a start).
# (Measured with an import audit hook in a forked server: what it still imported after the fork.)
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.image_utils",
    "PIL.Image",
    "trillm._native",
    "trillm.bench.serve",
    "trillm.entrypoints.cli.main",
    "trillm.entrypoints.cli.serve_args",
    "trillm.entrypoints.openai.api_server",
    "trillm.engine.async_engine",
    "trillm.engine.engine_startup",
    "trillm.engine.core",
    "trillm.executor.factory",
    "trillm.executor.multiproc",
    "trillm.executor.rank_server",
)
# Every child gets a rank zygote server of its own, forked from it at its start
# (tests/support/rank_servers.py): its engines fork their ranks from it, a one-rank engine's
# too, instead of spawning a worker that imports torch again (~2 s of CPU each).
WORKER_START = "TRILLM_WORKER_START"
# Room in this process's command line for a rank's, which each forked rank writes over it
# (trillm/executor/rank_zygote.py's set_cmdline), so that ps shows the worker it is.
CMDLINE_ROOM = " " * 4096
_IMPORT_ENV: dict[str, str] = {}  # the environment this zygote imported torch under


def forks_ranks(env: dict[str, str]) -> bool:
    """Whether a child's engines fork their ranks (one or several) from a rank zygote server:
    unless its environment asks for every rank to be spawned (which the server would refuse)."""
    return env.get(WORKER_START) != "spawn"


# --- the zygote program -----------------------------------------------------------------------


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m trillm serve ARGS`` and never return. (The
    zygote's channels are its stdin and stdout, which the log and /dev/null replace.)"""
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if forks_ranks(request["env"]):
            _fork_rank_server()
        from trillm.entrypoints.cli.main import main

        sys.argv = [str(Path(request["cwd"]) / "trillm" / "__main__.py"), *request["args"]]
        code = main(request["args"])  # ``serve`` ends the process itself
    except SystemExit as exc:  # argparse's refusals, as ``python -m trillm`` exits on them
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as Python reports an uncaught error
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fork_rank_server() -> None:
    """A rank zygote server of this server's own (its child, with everything imported): its
    engine forks its ranks from it (``TRILLM_RANK_ZYGOTE``) instead of a fresh zygote."""
    from trillm import envs
    from trillm.executor import rank_server

    address = f"@trillm-rank-zygote-{os.getpid()}"
    rank_server.fork_server(address, _IMPORT_ENV)
    os.environ[envs.RANK_ZYGOTE.name] = address


def _reap(children: set[int]) -> list[tuple[int, int]]:
    ended = []
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            ended.append((pid, code))
    return ended


def serve_forever() -> None:
    sys.path[0] = os.getcwd()  # as ``python -m`` has it: the repository, not this folder
    import importlib

    _IMPORT_ENV.update(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    from trillm.executor import rank_zygote

    rank_zygote.preload()  # what a rank imports, for the servers' rank zygote servers
    assert threading.active_count() == 1, "the zygote must not fork with threads running"
    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    children: set[int] = set()
    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        for pid, code in _reap(children):
            out.write(json.dumps({"exit": pid, "code": code}) + "\n")
            out.flush()
        if not readable:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            out.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            children.add(pid)
            out.write(json.dumps({"pid": pid}) + "\n")
            out.flush()
    for pid in children:  # the test session is gone: so are its servers
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


# --- the test side ----------------------------------------------------------------------------


class ZygoteChild:
    """A forked ``trillm serve``, with the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._zygote.wait_for_news(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid the zygote has reaped (it may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process of this test worker and what it has told us."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self._cwd = cwd
        from trillm.executor.worker_ipc import WORKER_GOMP_SPINCOUNT

        # The rank zygote servers forked from here hold the OpenMP spin their ranks would set
        # (worker_env), which OpenMP reads once, when torch loads it.
        self._proc = subprocess.Popen(
            [sys.executable, __file__, CMDLINE_ROOM],
            cwd=cwd,
            env={"GOMP_SPINCOUNT": WORKER_GOMP_SPINCOUNT, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        self._lines = self._proc.stdout
        self._exits: dict[int, int] = {}
        self._pids: list[int] = []
        self._news = threading.Condition()
        self._spawning = threading.Lock()  # one request at a time: pids come back in order
        ready = json.loads(self._lines.readline() or b"null")
        if not ready:
            raise RuntimeError(f"the serve zygote did not start (exit {self._proc.wait()})")
        threading.Thread(target=self._listen, name="serve-zygote", daemon=True).start()

    def _listen(self) -> None:
        for line in self._lines:
            message = json.loads(line)
            with self._news:
                if "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                else:
                    self._pids.append(message["pid"])
                self._news.notify_all()

    def spawn(self, args: list[str], env: dict[str, str], log: Path) -> ZygoteChild:
        request = {"args": args, "env": env, "cwd": str(self._cwd), "log": str(log)}
        assert self._proc.stdin is not None
        with self._spawning, self._news:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            while not self._pids:
                if not self._news.wait(60):
                    raise RuntimeError("the serve zygote did not fork")
            return ZygoteChild(self, self._pids.pop(0), args)

    def close(self) -> None:
        """End the zygote (and any server still running: the session is over)."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait()
        self._lines.close()

    def exit_code(self, pid: int) -> int | None:
        with self._news:
            return self._exits.get(pid)

    def wait_for_news(self, timeout: float) -> None:
        with self._news:
            self._news.wait(timeout)


if __name__ == "__main__":
    serve_forever()
