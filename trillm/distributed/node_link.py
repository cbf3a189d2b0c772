"""The executor's messages across nodes: rank 0 forwards them, the other nodes' ranks answer.

On one node every rank reads the executor's shared-memory ring. A rank on another machine
cannot, so with ``nnodes > 1`` rank 0 is the relay (the gloo control group of rank 0 and the
other nodes' ranks, ``TensorParallelGroup.control``):

    executor --ring--> rank 0 --broadcast(frame)--> ranks of nodes 1.. (before rank 0 acts on it)
    rank 0 --ring--> executor: rank 0's reply, then each remote rank's (in rank order), which
                     rank 0 receives from them (``send`` / ``recv``) after its own reply

A frame crosses as two broadcasts: its length (int64) and its bytes (uint8). A length of 0 is
a heartbeat: rank 0 sends one whenever the ring has been idle for ``heartbeat_s``, so that the
other nodes' waits never reach the collective timeout while the engine is idle, and so that a
node that died is noticed while idle too (the broadcast fails).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from trillm.distributed.parallel_state import TensorParallelGroup
from trillm.errors import CollectiveTimeoutError

HEARTBEAT_MAX_S = 10.0


class NodeLink:
    def __init__(self, group: TensorParallelGroup, remote_ranks: list[int]) -> None:
        if group.control is None:
            raise ValueError("NodeLink needs a group joined with remote ranks.")
        self.group = group
        self.remote_ranks = remote_ranks
        self.heartbeat_s = min(HEARTBEAT_MAX_S, group.timeout_s / 4)
        self._last_sent = time.monotonic()

    def _run(self, op: str, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        try:
            fn(*args, group=self.group.control, **kwargs)
        except RuntimeError as exc:  # gloo reports a timeout or a lost peer this way
            raise CollectiveTimeoutError(
                f"Rank {self.group.rank}: {op} between the nodes failed (a rank on another "
                f"node stopped answering within {self.group.timeout_s:g} s or died): {exc}",
                rank=self.group.rank,
                op=op,
            ) from exc

    # ------------------------------------------------------------ rank 0

    def broadcast(self, frame: bytes) -> None:
        """Send ``frame`` (b"": a heartbeat) to every remote rank."""
        self._run("broadcast", dist.broadcast, torch.tensor([len(frame)]), 0)
        if frame:
            data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)  # [len(frame)]
            self._run("broadcast", dist.broadcast, data, 0)
        self._last_sent = time.monotonic()

    def heartbeat_if_idle(self) -> None:
        if time.monotonic() - self._last_sent >= self.heartbeat_s:
            self.broadcast(b"")

    def replies(self) -> list[bytes]:
        """One reply frame from each remote rank, in rank order."""
        frames = []
        for rank in self.remote_ranks:
            size = torch.zeros(1, dtype=torch.int64)
            self._run("recv", dist.recv, size, rank)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self._run("recv", dist.recv, data, rank)
            frames.append(data.numpy().tobytes())
        return frames

    # ------------------------------------------------------------ a remote rank

    def receive(self) -> bytes:
        """The next frame rank 0 broadcast (heartbeats skipped)."""
        while True:
            size = torch.zeros(1, dtype=torch.int64)
            self._run("broadcast", dist.broadcast, size, 0)
            if size.item():
                data = torch.empty(int(size.item()), dtype=torch.uint8)
                self._run("broadcast", dist.broadcast, data, 0)
                return data.numpy().tobytes()

    def send_reply(self, frame: bytes) -> None:
        self._run("send", dist.send, torch.tensor([len(frame)]), 0)
        self._run("send", dist.send, torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0)
