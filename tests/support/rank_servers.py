"""Multi-rank engines of a test session forking their ranks from one rank zygote server.

Every multi-rank engine start otherwise starts a rank zygote of its own, a fresh Python that
imports torch and the worker (~3.5 s of CPU on 2 cores), and the parallel tests start about
two hundred. A server (trillm/executor/rank_server.py) imports them once and forks each start's
ranks; the ranks must become children of the engine's process, so the server must descend
from it:

- the engines this worker runs in-process (``LLM(...)``, executors): ``ranks_from_one_zygote()``
  starts one server per pytest worker, at the first module that asks, and names it in
  ``TRILLM_RANK_ZYGOTE`` while that module runs;
- the ``trillm serve`` a test starts (forked from the serve zygote, which has imported torch):
  ``serve_zygote.py`` forks each server its own rank zygote server at its start, from which its
  engines fork their ranks, a one-rank engine's too (a worker spawned instead imports torch
  again: ~2 s of CPU per server start).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from trillm import envs
from trillm.executor import rank_server
from trillm.executor.worker_ipc import worker_env

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0

_SERVER: list[subprocess.Popen[bytes]] = []


def _answers(address: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(rank_server.socket_address(address))
        except OSError:
            return False
    return True


def _stop() -> None:
    proc = _SERVER.pop()
    proc.terminate()
    proc.wait()


def _server_address() -> str:
    """This worker's server, started at the first call; it ends with the worker."""
    address = f"@trillm-rank-zygote-{os.getpid()}"
    if not _SERVER:
        argv = [sys.executable, "-m", rank_server.MODULE, "--socket", address]
        if threading.current_thread() is threading.main_thread():
            # It ends with this worker even when the worker is killed (no atexit then). Only
            # from the main thread: the kernel signals it when the thread that started it ends.
            argv += ["--parent", str(os.getpid())]
        _SERVER.append(subprocess.Popen(argv, cwd=REPO, env=worker_env()))
        atexit.register(_stop)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(address):  # it listens before it imports
            if _SERVER[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rank zygote server did not start ({_SERVER[0].poll()})")
            time.sleep(0.02)
    return address


@contextlib.contextmanager
def ranks_from_one_zygote() -> Iterator[None]:
    """Inside, this process's multi-rank engines fork their ranks from this worker's server."""
    name = envs.RANK_ZYGOTE.name
    previous = os.environ.get(name)
    os.environ[name] = _server_address()
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous
