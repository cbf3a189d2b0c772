"""How ``MultiprocExecutor`` starts its worker processes and talks to them.

``WorkerIpc`` owns one executor's shared-memory rings, their eventfds and the parent-death
pipe, and builds each worker's command line (``trillm/worker/worker_main.py`` parses it) with
the fds it inherits; ``worker_env`` is the environment every worker starts with (``trillm
serve --headless`` starts its node's workers with it too); ``rendezvous_listener`` binds the
tensor-parallel rendezvous port, which rank 0 inherits.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict
from pathlib import Path

import trio

from trillm.errors import IPCError
from trillm.ipc import codec
from trillm.ipc.control import WorkerFailed
from trillm.ipc.shm_ring import RingReader, RingWriter
from trillm.ipc.shm_segment import RingFds, ShmRing


def rendezvous_listener() -> socket.socket:
    """A TCP socket listening on a free loopback port: rank 0 inherits it and serves the
    tensor-parallel rendezvous on it (a port picked, closed and bound again later could be
    taken in between by anything else on the machine)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


# OpenMP threads of torch's GOMP runtime spin this many times after a parallel region before
# they sleep. GOMP's default (300,000, ~1 ms here) keeps torch's idle threads busy on the cores
# through most of each layer's attention call, which runs on the CPU attention kernel's own
# threads: on 2 cores a decode layer's attention took 4.7-5.2 ms that way against 2.9-3.1 ms
# with 20,000, and the GEMMs around it did not slow down (benchmarks/archive/RESULTS-journal.md, section 2).
WORKER_GOMP_SPINCOUNT = "20000"


def worker_env() -> dict[str, str]:
    """This environment, with the folder holding ``trillm`` first on PYTHONPATH, so the worker
    imports the same package whatever its working directory, and GOMP_SPINCOUNT set (unless the
    user set it) before the worker loads torch."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding trillm/
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}
    env.setdefault("GOMP_SPINCOUNT", WORKER_GOMP_SPINCOUNT)
    return env


class WorkerIpc:
    """The rings, eventfds and parent-death pipe of one executor; owned by it alone."""

    def __init__(
        self,
        num_workers: int,
        num_slots: int,
        slot_size: int,
        rendezvous: socket.socket | None = None,
    ) -> None:
        # The rendezvous port's listening socket, for rank 0 (closed here once it has started).
        self.rendezvous = rendezvous
        self.request_ring = ShmRing.create(num_workers, num_slots, slot_size)
        self.request_fds = RingFds.create(self.request_ring.name, num_workers)
        self.result_rings = [ShmRing.create(1, num_slots, slot_size) for _ in range(num_workers)]
        self.result_fds = [RingFds.create(r.name, 1) for r in self.result_rings]
        # The workers hold the read end; EOF there means this process is gone.
        self.death_r, self.death_w = os.pipe()
        self.requests = RingWriter(self.request_ring, self.request_fds)
        self.results = [RingReader(r, 0, f) for r, f in zip(self.result_rings, self.result_fds)]

    def worker_args(self, rank: int, engine: int = 0) -> tuple[list[str], list[int]]:
        """-> (the worker's arguments: its command line after ``python -m
        trillm.worker.worker_main``, the fds it inherits); ``engine``: the engine core (data
        parallelism) the worker serves, on its command line so that ps tells them apart."""
        res = self.result_fds[rank]
        argv = [
            "--rank",
            str(rank),
            "--engine",
            str(engine),
            "--request-ring",
            json.dumps(asdict(self.request_fds)),
            "--result-ring",
            json.dumps(asdict(res)),
            "--death-fd",
            str(self.death_r),
            "--parent-pid",
            str(os.getpid()),
        ]
        fds = [self.request_fds.data_fds[rank], self.request_fds.space_fd, *res.all_fds()]
        if rank == 0 and self.rendezvous is not None:
            argv += ["--rendezvous-fd", str(self.rendezvous.fileno())]
            fds.append(self.rendezvous.fileno())
        return argv, [*fds, self.death_r]

    def close_death_read_end(self) -> None:
        """The workers hold the death pipe's read end (and rank 0 the rendezvous socket) now."""
        os.close(self.death_r)
        self.death_r = -1
        self.close_rendezvous()

    def close_rendezvous(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None

    def segment_names(self) -> list[str]:
        return [self.request_ring.name, *(r.name for r in self.result_rings)]

    def last_words(self, rank: int) -> WorkerFailed | None:
        """The WorkerFailed a worker left on its result ring, if any."""
        # NOTE: synchronous, so it cannot interleave with a recv() suspended on this reader.
        try:
            while (frame := self.results[rank].try_recv()) is not None:
                msg = codec.decode(frame)
                if isinstance(msg, WorkerFailed):
                    return msg
        except IPCError:
            pass
        return None

    def unlink(self) -> None:
        for ring in (self.request_ring, *self.result_rings):
            ring.unlink()

    def close(self) -> None:
        """Unlink and unmap everything, close every fd (no task may be waiting on them)."""
        self.unlink()
        self.close_rendezvous()
        fds = [*self.request_fds.all_fds(), self.death_r, self.death_w]
        for f in self.result_fds:
            fds.extend(f.all_fds())
        for fd in (fd for fd in fds if fd >= 0):
            trio.lowlevel.notify_closing(fd)
            try:
                os.close(fd)
            except OSError:
                pass
        for ring in (self.request_ring, *self.result_rings):
            ring.close()
