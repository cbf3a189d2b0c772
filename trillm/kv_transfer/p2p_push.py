"""The P2P connector's push modes (vLLM's send_type "PUT" and "PUT_ASYNC"): the prefill
instance's worker sends each computed prompt's KV to the decode instance named in the request
id; the decode instance's engine core listens on its ``kv_ip:kv_port`` and holds what came
until the request arrives.

A push is ``PUT <key>\\n``, an 8-byte little-endian length and that many bytes; the answer
one byte (1: kept, 0: refused). The sender (``Pusher``) pushes only to the decode addresses
its operator lists (``decode_kv_addrs``); "PUT" pushes inside the step that computed the
prompt, "PUT_ASYNC" hands it to a background thread (a queue of at most ``PUSH_QUEUE_BYTES``;
one that does not fit is dropped: its decode request recomputes). A producer's
``kv_buffer_size`` is its "GET" store's size (vLLM's PUT examples set it to 10 bytes).

The receiver (``PushPool``) takes pushes only from the IPs of its listed prefill instances
(``prefill_kv_addrs``), each sender at most an equal share of its bound (``kv_buffer_size`` +
``mem_pool_size_gb``), and evicts an entry nobody claimed after ``UNCLAIMED_TTL_S`` or to make
room for its sender's newer one (oldest first). Under tensor or pipeline parallelism rank ``r``
of the prefill instance pushes its share to ``port + r`` of the decode address, where the
decode instance's rank-``r`` listener (``PushServer(..., rank=r)``) files it under its rank;
a request takes a prompt's shares only all together (``PushPool.claim_all``).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from trillm.kv_transfer import p2p_wire
from trillm.kv_transfer.log_every import EveryWarning
from trillm.kv_transfer.p2p_wire import TRANSFER_TIMEOUT_S

logger = logging.getLogger(__name__)

PUSH_QUEUE_BYTES = 2**30  # "PUT_ASYNC": the prompts' KV waiting for the sender thread
UNCLAIMED_TTL_S = 60.0  # a pushed prompt no request claimed by then is dropped
_LENGTH_BYTES = 8


def push(host: str, port: int, key: str, blob: bytes) -> bool:
    """Sends ``blob`` under ``key`` -> whether the decode instance kept it. OSError: not
    sent (no listener, dropped, past the deadline)."""
    deadline = time.monotonic() + p2p_wire.payload_deadline_s(len(blob))
    with socket.create_connection((host, port), timeout=p2p_wire.FIRST_BYTE_TIMEOUT_S) as conn:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        conn.sendall(b"PUT " + key.encode("ascii") + b"\n" + len(blob).to_bytes(8, "little"))
        conn.sendall(blob)
        answer = p2p_wire.read_exactly(conn, 1, deadline)
    return answer == b"\x01"


class Pusher:
    """The prefill instance's worker side of a push mode."""

    def __init__(self, asynchronous: bool, queue_bytes: int) -> None:
        self.asynchronous = asynchronous
        self.queue_bytes = queue_bytes
        self.sent = 0
        self.failed = 0
        self._queue: collections.deque[tuple[str, str, bytes]] = collections.deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._warning = EveryWarning(logger, "pushes not sent")
        if asynchronous:
            threading.Thread(target=self._send_loop, name="trillm-kv-p2p-push", daemon=True).start()

    def send(self, address: str, key: str, blob: bytes) -> None:
        if not self.asynchronous:
            self._send(address, key, blob)  # NOTE: "PUT": inside the step, as vLLM's
            return
        with self._cond:
            if self._queued + len(blob) > self.queue_bytes:
                self.failed += 1
                self._warning.warn("KV push to %s dropped: the send queue is full", address)
                return
            self._queue.append((address, key, blob))
            self._queued += len(blob)
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until the queue is empty (tests)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._queued and time.monotonic() < end:
                self._cond.wait(0.01)

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                address, key, blob = self._queue[0]
            self._send(address, key, blob)
            with self._cond:
                self._queue.popleft()
                self._queued -= len(blob)
                self._cond.notify_all()

    def _send(self, address: str, key: str, blob: bytes) -> None:
        host, port = address.rsplit(":", 1)
        try:
            kept = push(host.strip("[]"), int(port), key, blob)
        except OSError as exc:
            kept = False
            self._warning.warn(
                "KV push to %s failed: %s (its decode request recomputes)", address, exc
            )
        self.sent += kept
        self.failed += not kept


class PushPool:
    """The decode instance's pushed prompts' shares, by (key, rank), until a request claims
    them."""

    def __init__(self, capacity: int, senders: frozenset[str]) -> None:
        self.capacity = capacity
        self.senders = senders  # the IPs pushes are taken from
        self.share = capacity // max(1, len(senders))  # what one sender may make it hold
        self.refused = 0
        self.evicted = 0
        self._lock = threading.Lock()
        # (key, rank) -> (sender IP, bytes, when it came); oldest first
        self._items: OrderedDict[tuple[str, int], tuple[str, bytes, float]] = OrderedDict()
        self._bytes_of: dict[str, int] = dict.fromkeys(senders, 0)
        # the receiver's hook: (key, rank) came, a request may wait for it
        self.on_arrival: Callable[[str, int], None] = lambda key, rank: None

    def claim(self, key: str, rank: int = 0) -> bytes | None:
        with self._lock:
            self._expire()
            return self._pop((key, rank))

    def claim_all(self, key: str, world_size: int) -> list[bytes] | None:
        """Every rank's share of ``key``, taken together; None (nothing taken) until each
        came."""
        with self._lock:
            self._expire()
            if any((key, rank) not in self._items for rank in range(world_size)):
                return None
            return [self._pop((key, rank)) or b"" for rank in range(world_size)]

    def peek(self, key: str, rank: int) -> bytes | None:
        """Rank ``rank``'s share of ``key``, left in the pool."""
        with self._lock:
            item = self._items.get((key, rank))
            return None if item is None else item[1]

    def offer(self, sender: str, key: str, size: int) -> bool:
        """Room for ``size`` bytes from ``sender`` (its older entries go first if need be)."""
        if sender not in self.senders or size > self.share:
            return False
        with self._lock:
            self._expire()
            for old in [k for k, v in self._items.items() if v[0] == sender]:
                if self._bytes_of[sender] + size <= self.share:
                    break
                self._drop(old)
            return self._bytes_of[sender] + size <= self.share

    def put(self, sender: str, key: str, blob: bytes, rank: int = 0) -> bool:
        if not self.offer(sender, key, len(blob)):
            return False
        with self._lock:
            if (key, rank) in self._items:
                self._drop((key, rank))
            self._items[key, rank] = (sender, blob, time.monotonic())
            self._bytes_of[sender] += len(blob)
        self.on_arrival(key, rank)
        return True

    def refuse(self) -> None:
        """Counts a push refused (the listeners' threads, each rank's, at once)."""
        with self._lock:
            self.refused += 1

    def held_bytes(self, sender: str) -> int:
        with self._lock:
            return self._bytes_of.get(sender, 0)

    def __len__(self) -> int:
        return len(self._items)

    def _pop(self, where: tuple[str, int]) -> bytes | None:
        item = self._items.pop(where, None)
        if item is None:
            return None
        self._bytes_of[item[0]] -= len(item[1])
        return item[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            where, (_, _, came) = next(iter(self._items.items()))
            if now - came < UNCLAIMED_TTL_S:
                return
            self._drop(where)

    def _drop(self, where: tuple[str, int]) -> None:
        sender, blob, _ = self._items.pop(where)
        self._bytes_of[sender] -= len(blob)
        self.evicted += 1


class PushServer(p2p_wire.Listener):
    """Takes pushes on ``(ip, port)`` into ``pool``, each filed under ``rank`` (the rank of
    the decode instance this listener serves: ``kv_port + rank``)."""

    name = "trillm-kv-p2p-push-server"

    def __init__(self, pool: PushPool, ip: str, port: int, rank: int = 0) -> None:
        self.pool = pool
        self.rank = rank
        super().__init__(ip, port)

    def _admit(self, conn: socket.socket, peer: str) -> bool:
        if peer not in self.pool.senders:
            self.pool.refuse()
            return False  # NOTE: not a listed prefill instance: not read at all
        return True

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            with conn:
                deadline = time.monotonic() + TRANSFER_TIMEOUT_S
                head = p2p_wire.read_exactly(
                    conn, 4 + p2p_wire.KEY_CHARS + 1 + _LENGTH_BYTES, deadline
                )
                key = head[4 : 4 + p2p_wire.KEY_CHARS].decode("ascii", "replace")
                size = int.from_bytes(head[-_LENGTH_BYTES:], "little")
                ok = head.startswith(b"PUT ") and p2p_wire.is_key(key)
                if not ok or not self.pool.offer(peer, key, size):
                    self.pool.refuse()
                    conn.sendall(b"\x00")
                    return
                blob = p2p_wire.read_exactly(
                    conn, size, time.monotonic() + p2p_wire.payload_deadline_s(size)
                )
                kept = self.pool.put(peer, key, blob, self.rank)
                conn.sendall(b"\x01" if kept else b"\x00")
        except OSError as exc:
            logger.info("KV push from %s dropped: %s", peer, exc)
