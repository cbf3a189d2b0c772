"""One rank inside a Ray actor (``--distributed-executor-backend ray``).

The actor runs the worker process's own message handling (``worker_main.Worker``): the same
codec frames (InitWorker, InitKVCache, SchedulerOutput, SampleRequest, WorkerCall, Shutdown)
arrive as the arguments of ``handle`` instead of over the request ring, and the replies the
worker would write to its result ring are returned by that call. Ray runs one actor's calls
one at a time in the order the executor submitted them, which is the ring's order.

This module imports no Ray: ``ray_executor.py`` wraps ``RankActor`` with ``ray.remote``.
"""

from __future__ import annotations

import os
import socket
import traceback

from trillm.distributed.parallel_state import adopt_rendezvous_listener
from trillm.errors import CollectiveTimeoutError
from trillm.ipc import codec
from trillm.ipc.control import Shutdown, WorkerFailed
from trillm.worker.worker_main import Worker


class _CallWorker(Worker):
    """A ``Worker`` whose replies are kept for the current call's return value."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, None, None, os.getppid())
        self.replies: list[bytes] = []

    def _send(self, msg: codec.Message, timeout: float | None = None) -> None:
        self.replies.append(codec.encode(msg))

    def answer(self, msg: codec.Message) -> None:
        """Act on ``msg`` as the ring's worker does; its replies land in ``replies``."""
        self._handle(msg)


class RankActor:
    """Rank ``rank`` of the executor's world; its calls come from ``RayExecutor`` only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker = _CallWorker(rank)
        self._rendezvous: socket.socket | None = None

    def where(self) -> tuple[str, str, int]:
        """-> (this actor's node address, its Ray node id, its process id)."""
        import ray

        node_id: str = ray.get_runtime_context().get_node_id()
        return ray.util.get_node_ip_address(), node_id, os.getpid()

    def ping(self) -> None:
        """Answered between calls: the executor's liveness probe."""

    def bind_rendezvous(self, addr: str) -> int:
        """Rank 0: listen on a free port of ``addr`` for the torch.distributed store and serve
        the store on that socket later (no other program can take the port in between) -> the
        port."""
        sock = socket.socket()
        sock.bind((addr, 0))
        sock.listen(128)
        self._rendezvous = sock
        adopt_rendezvous_listener(sock.fileno())
        port: int = sock.getsockname()[1]
        return port

    def handle(self, frame: bytes) -> list[bytes]:
        """One message -> the frames this rank answers it with (none for most steps' first
        half, a ``WorkerFailed`` when it fails outside a step's model code)."""
        try:
            msg = codec.decode(frame)
            if isinstance(msg, Shutdown):
                if self.worker.runner is not None:
                    self.worker.runner.shutdown()
                return []
            self.worker.answer(msg)
        except Exception as exc:
            message = f"Worker rank {self.rank} failed: {exc}\n{traceback.format_exc()}"
            collective = isinstance(exc, CollectiveTimeoutError)
            self.worker.replies.append(codec.encode(WorkerFailed(self.rank, message, collective)))
        replies, self.worker.replies = self.worker.replies, []
        return replies
