"""What the parallel and executor tests look for in /proc and /dev/shm: whether a process
lives, a server's model workers by rank, the shared-memory segments it maps."""

from __future__ import annotations

import os
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


def worker_ranks(pid: int) -> dict[int, int]:
    """rank -> pid of the server's model workers."""
    ranks = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"trillm.worker.worker_main" in argv:
                ranks[int(argv[argv.index(b"--rank") + 1])] = int(child)
    return ranks


def shm_segments(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/" in line}
