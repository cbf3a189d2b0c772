"""What the parallel and executor tests look for in /proc and /dev/shm: whether a process
lives, a server's model workers by rank (and engine core), the shared-memory segments it
maps."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def _workers(pid: int) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of each of the server's model workers."""
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"trillm.worker.worker_main" in argv:
                yield int(child), argv


def worker_ranks(pid: int) -> dict[int, int]:
    """rank -> pid of the server's model workers."""
    return {int(argv[argv.index(b"--rank") + 1]): child for child, argv in _workers(pid)}


def core_worker_ranks(pid: int) -> dict[tuple[int, int], int]:
    """(engine core index, rank) -> pid of the server's model workers (-dp N)."""
    return {
        (int(argv[argv.index(b"--engine") + 1]), int(argv[argv.index(b"--rank") + 1])): child
        for child, argv in _workers(pid)
    }


def shm_segments(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/" in line}
