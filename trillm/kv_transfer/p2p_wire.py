"""The P2P connector's transport: the prefill instance's worker keeps each saved prompt's KV
(``storage.pack``'s bytes) in a bounded store and serves it over TCP on ``kv_ip:kv_port``;
the decode instance's worker asks for a key and reads the answer, within a deadline.

A request is ``GET <key>\\n`` (the key: 40 hex digits); the answer an 8-byte little-endian
length (0: not held) and that many bytes. No authentication (vLLM's P2P connector has none):
the server binds ``kv_ip`` only, and its peers should be on a private network.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

logger = logging.getLogger(__name__)

KEY_CHARS = 40  # storage.prefix_key: BLAKE2b-160, hex
_LENGTH_BYTES = 8
# NOTE: a peer gets this long for its request line (the server's threads, not a step)
TRANSFER_TIMEOUT_S = 10.0
# A fetch runs off the decode instance's steps (p2p_recv.py) while its request waits: the
# prefill instance answers from memory, so the connection and the answer's length get this
# long, and the payload FIRST_BYTE_TIMEOUT_S more plus its size at MIN_RATE_BYTES_S. A slower
# or silent peer costs that request's first token at most that, then it recomputes.
FIRST_BYTE_TIMEOUT_S = 1.0
MIN_RATE_BYTES_S = 50e6
MAX_CONNECTIONS = 16  # concurrent peers a server answers; more are closed at once
JOIN_S = 5.0  # a closed server waits this long for each of its threads


class SendStore:
    """Prompts' KV waiting for the decode instance, at most ``capacity`` bytes: the oldest go
    first (their decode requests recompute), and one larger than ``capacity`` is not kept."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.bytes = 0
        self.evicted = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: str, blob: bytes) -> bool:
        if len(blob) > self.capacity:
            logger.warning("KV of %d bytes is over kv_buffer_size alone: not kept", len(blob))
            return False
        with self._lock:
            old = self._items.pop(key, None)
            self.bytes -= 0 if old is None else len(old)
            while self.bytes + len(blob) > self.capacity:
                _, dropped = self._items.popitem(last=False)
                self.bytes -= len(dropped)
                self.evicted += 1
            self._items[key] = blob
            self.bytes += len(blob)
        return True

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._items.get(key)

    def __len__(self) -> int:
        return len(self._items)


def listen(ip: str, port: int) -> socket.socket:
    """A TCP socket listening on ``(ip, port)`` (an IPv6 one for an address with ':'), at
    most ``MAX_CONNECTIONS`` peers waiting; ValueError naming the address where it cannot."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ip, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"kv_transfer_config: cannot listen on {ip}:{port}: {exc}") from exc
    sock.listen(MAX_CONNECTIONS)
    return sock


class Listener:
    """Accepts peers on ``(ip, port)`` on a thread of its own and serves each on one of its own
    (``_serve``), at most ``MAX_CONNECTIONS`` at once (more are closed at once, as is a peer
    ``_admit`` refuses). ``close`` stops accepting, drops the peers being served and joins
    every thread (each within ``JOIN_S``), so the port is free and no thread is left."""

    name = "trillm-kv-p2p-server"

    def __init__(self, ip: str, port: int) -> None:
        self._sock = listen(ip, port)
        self.address = self._sock.getsockname()[:2]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._peers: dict[threading.Thread, socket.socket] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=self.name, daemon=True)
        self._thread.start()

    def _admit(self, conn: socket.socket, peer: str) -> bool:
        return True

    def _serve(self, conn: socket.socket, peer: str) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                conn, address = self._sock.accept()
            except OSError:
                return  # closed
            peer = str(address[0]).removeprefix("::ffff:")
            if not self._admit(conn, peer) or not self._slots.acquire(blocking=False):
                conn.close()  # NOTE: refused, or busy: that peer recomputes
                continue
            thread = threading.Thread(
                target=self._run, args=(conn, peer), name=f"{self.name}-peer", daemon=True
            )
            with self._lock:
                if self._closed:
                    conn.close()
                    self._slots.release()
                    return
                self._peers[thread] = conn
            thread.start()

    def _run(self, conn: socket.socket, peer: str) -> None:
        try:
            self._serve(conn, peer)
        finally:
            self._slots.release()
            with self._lock:
                self._peers.pop(threading.current_thread(), None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = dict(self._peers)
        for sock in (self._sock, *peers.values()):
            with contextlib.suppress(OSError):  # wakes the accept and the peers' reads
                sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for thread in (self._thread, *peers):
            thread.join(JOIN_S)


class KVServer(Listener):
    """Serves ``store`` on ``(ip, port)``: a prefill instance's rank's share of each prompt."""

    def __init__(self, store: SendStore, ip: str, port: int) -> None:
        self.store = store
        super().__init__(ip, port)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            with conn:
                conn.settimeout(TRANSFER_TIMEOUT_S)
                key = _read_request(conn)
                blob = None if key is None else self.store.get(key)
                if blob is None:
                    conn.sendall(bytes(_LENGTH_BYTES))
                    return
                conn.sendall(len(blob).to_bytes(_LENGTH_BYTES, "little"))
                conn.sendall(blob)
        except OSError as exc:
            logger.info("KV peer dropped: %s", exc)


def _read_request(conn: socket.socket) -> str | None:
    want = len(b"GET ") + KEY_CHARS + 1
    line = read_exactly(conn, want, time.monotonic() + TRANSFER_TIMEOUT_S)
    key = line[4:-1].decode("ascii", "replace")
    if not line.startswith(b"GET ") or not line.endswith(b"\n") or not is_key(key):
        return None
    return key


def is_key(key: str) -> bool:
    return len(key) == KEY_CHARS and all(c in "0123456789abcdef" for c in key)


class Fetches:
    """The connections of the fetches running now: ``close`` shuts them down, so that each
    fails at once rather than at its deadline (a fetch's payload may take many seconds), and
    a fetch begun after it fails before it connects."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False

    @contextlib.contextmanager
    def connect(self, host: str, port: int) -> Iterator[socket.socket]:
        self._check()
        with socket.create_connection((host, port), timeout=FIRST_BYTE_TIMEOUT_S) as conn:
            with self._lock:
                self._open.add(conn)
            try:
                self._check()  # NOTE: closed while it connected
                yield conn
            finally:
                with self._lock:
                    self._open.discard(conn)

    def _check(self) -> None:
        if self._closed:
            raise ConnectionAbortedError("the engine stops")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):  # wakes its read: it fails at once
                conn.shutdown(socket.SHUT_RDWR)


def fetch(
    host: str, port: int, key: str, max_bytes: int, fetches: Fetches | None = None
) -> bytes | None:
    """The bytes the server at ``host:port`` holds for ``key``; None when it holds none.
    OSError (refused, dropped, past its deadline: ``payload_deadline_s``, or ``fetches``
    closed) or ValueError (an answer over ``max_bytes``): the caller recomputes."""
    deadline = time.monotonic() + FIRST_BYTE_TIMEOUT_S
    with (fetches or Fetches()).connect(host, port) as conn:
        conn.sendall(b"GET " + key.encode("ascii") + b"\n")
        size = int.from_bytes(read_exactly(conn, _LENGTH_BYTES, deadline), "little")
        if size == 0:
            return None
        if size > max_bytes:
            raise ValueError(f"the prefill instance sent {size} bytes, over the {max_bytes} asked")
        return read_exactly(conn, size, time.monotonic() + payload_deadline_s(size))


def payload_deadline_s(size: int) -> float:
    """Seconds a fetch waits for a ``size``-byte answer once its length came."""
    return FIRST_BYTE_TIMEOUT_S + size / MIN_RATE_BYTES_S


def read_exactly(conn: socket.socket, size: int, deadline: float) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"KV transfer past its deadline, {got} of {size} bytes read")
        conn.settimeout(left)
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {size} bytes")
        got += n
    return bytes(buf)
