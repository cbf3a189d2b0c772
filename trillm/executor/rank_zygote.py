"""The rank zygote: one process that imports torch and the worker's modules once, then forks
every rank of an executor from that state (``python -m trillm.executor.rank_zygote``).

Each rank used to start as ``python -m trillm.worker.worker_main`` of its own, and importing
torch and the model code cost ~3.5 s of CPU per rank on this project's 2-core machines: 14 s
of a 4-rank (TP=2 x PP=2) start. The zygote pays it once. Its command line carries every
rank's (``--ranks``: a JSON list of ``[argv, fds]``, the worker's command line after ``python
-m trillm.worker.worker_main`` and the fds it keeps); it inherits the union of their fds (at
the same numbers, so every command line stays true), preloads, freezes its heap (the ranks
share its pages), forks one child per rank, writes each child's pid on ``--report-fd`` and
exits. Each child closes the other ranks' fds and waits until it is adopted by the executor's
process (a child subreaper while the zygote runs: ``rank_launch.py``), so that each rank is
that process's child as before: its parent pid is the one on its command line, and the
executor waits on it, reads its exit status and signals it (pidfds). The child then rewrites
its own command line in place, so ``ps`` shows ``python -m trillm.worker.worker_main --rank R
...`` as before, and runs the worker's ``main``.

Nothing here may start a thread pool or run a parallel torch op before the fork (a forked
GOMP pool does not survive): the zygote only imports.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import signal
import sys
import time
import traceback

# What a rank imports before its first message, beyond ``worker_main`` itself.
PRELOAD = (
    "trillm.worker.worker_main",
    "trillm.worker.model_runner",
    "trillm.distributed.worker",
    "trillm.attention.torch_backend",
    "trillm.model_executor.models",
    "trillm._ext.cpu_kernels",
)
WORKER_MODULE = "trillm.worker.worker_main"
ADOPTION_POLL_S = 0.002


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="trillm rank zygote (started by the executor)")
    p.add_argument("--report-fd", type=int, required=True, help="each forked rank's pid, a line")
    p.add_argument("--ranks", required=True, help="JSON list of [worker argv, kept fds]")
    return p.parse_args(argv)


def set_cmdline(argv: list[str]) -> bool:
    """Rewrite this process's command line (``/proc/self/cmdline``, what ``ps`` shows) in the
    memory the kernel reads it from, NUL-padded; False where it does not fit or cannot be
    found. The zygote's own command line holds every rank's, so a rank's always fits."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5): 48, 49)
    except (OSError, IndexError, ValueError):
        return False
    text = b"\0".join(a.encode() for a in argv) + b"\0"
    if len(text) > end - start:
        return False
    ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)
    return True


def _await_adoption(parent_pid: int, zygote: int) -> bool:
    """Wait until this child's parent is ``parent_pid`` (the zygote exits after its forks and
    the executor's process adopts its children); False if it went to any other process."""
    while (ppid := os.getppid()) != parent_pid:
        if ppid != zygote:
            return False
        time.sleep(ADOPTION_POLL_S)
    return True


def _run_rank(argv: list[str], keep: list[int], others: set[int], zygote: int) -> int:
    for fd in others - set(keep):
        os.close(fd)
    from trillm.worker import worker_main

    args = worker_main._parse(argv)
    if not _await_adoption(args.parent_pid, zygote):
        return worker_main.EXIT_PARENT_DIED
    full = [sys.executable, "-m", WORKER_MODULE, *argv]
    set_cmdline(full)
    sys.argv = [WORKER_MODULE, *argv]
    return worker_main.main(argv)


def ignore_signals() -> None:
    """Ctrl-C and a process-group SIGTERM are the executor's to handle (as in worker_main)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def preload() -> None:
    for name in PRELOAD:
        __import__(name)
    gc.collect()
    gc.freeze()  # the children share these pages: no collection of theirs writes to them


def fork_ranks(ranks: list[tuple[list[str], list[int]]], report_fd: int) -> int:
    """One child per rank (``[worker argv, kept fds]``), each running the worker once adopted;
    each child's pid a line on ``report_fd``. This process holds the union of the kept fds."""
    inherited = {fd for _, fds in ranks for fd in fds}
    zygote = os.getpid()  # a child's parent until it is adopted
    for rank_argv, keep in ranks:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(report_fd)
                code = _run_rank(rank_argv, keep, inherited, zygote)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # no interpreter finalization (see worker_main)
        os.write(report_fd, f"{pid}\n".encode())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    ignore_signals()
    ranks: list[tuple[list[str], list[int]]] = [
        (list(a), list(f)) for a, f in json.loads(args.ranks)
    ]
    preload()
    return fork_ranks(ranks, args.report_fd)


if __name__ == "__main__":
    code = main()
    # No interpreter finalization: over torch's modules it costs ~1 s, and the ranks wait for
    # this exit (their adoption) before they start.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
