"""A shared-memory ring: one writer, N readers, eventfd wake-ups. Linux only. The segment
(its layout, creating and attaching it, its eventfds) is ``trillm.ipc.shm_segment``; this
module is the protocol over it: ``RingWriter``, ``RingReader`` and how they wait.

Protocol (the invariant: ``min(read_count) <= write_count <= min(read_count) + num_slots``):
- The writer may fill chunk ``k = write_count`` only when ``k - min(read_count) < num_slots``
  (otherwise it waits: backpressure). It writes the payload, then the slot header, then
  stores ``write_count = k + 1`` and signals every reader's eventfd.
- Reader ``r`` may read chunk ``k = read_count[r]`` once ``write_count > k``. It checks the
  header (magic, seq == k, length <= slot_size, flags, crc32), copies the payload out, then
  stores ``read_count[r] = k + 1`` and signals the writer's ``space`` eventfd.
- NOTE: correctness relies on stores becoming visible in program order (x86 TSO); each counter
  is a single aligned 8-byte store through numpy. The checksum and the sequence number turn a
  torn or stale slot into ``RingCorruptError`` rather than silent garbage.

A message larger than a slot is split over consecutive chunks (FIRST on the first, LAST on the
last); readers reassemble it. Messages above ``max_message_size`` are rejected by the writer
(``MessageTooLargeError``) and treated as corruption by readers.

Waiting: poll the counters for ``spin_s`` (about 50 us), then sleep on an eventfd. Signals are
sent unconditionally (one ``write`` syscall per chunk and reader, about 1 us), so a wake-up is
never lost; a waiter drains its eventfd before re-checking, so stale signals only cost a
spurious wake-up. In Trio the sleep is ``trio.lowlevel.wait_readable`` (the loop never
blocks); in a plain process it is ``poll()`` with a timeout that calls ``idle_check`` (the
worker uses it to notice that its parent is gone).
"""

from __future__ import annotations

import os
import select
import time
import zlib
from collections.abc import Callable

from trillm.errors import MessageTooLargeError, RingClosedError, RingCorruptError
from trillm.ipc.shm_segment import (
    FIRST,
    LAST,
    SLOT_HEADER,
    SLOT_HEADER_SIZE,
    SLOT_MAGIC,
    RingFds,
    ShmRing,
)

DEFAULT_MAX_MESSAGE_SIZE = 1 << 30
SPIN_S = 50e-6
POLL_INTERVAL_S = 0.5


def _signal(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:  # counter saturated: the waiter is already due to wake
        pass
    except OSError:  # the fd is closed: the peer is shutting down
        pass


def _drain(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def _spin(ready: Callable[[], bool], spin_s: float) -> bool:
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        if ready():
            return True
    return ready()


def _wait_sync(
    ready: Callable[[], bool],
    fd: int,
    timeout: float | None,
    idle_check: Callable[[], None] | None,
) -> None:
    """Block until ``ready()``; ``TimeoutError`` after ``timeout`` seconds."""
    if _spin(ready, SPIN_S):
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        _drain(fd)
        if ready():
            return
        wait_s = POLL_INTERVAL_S
        if deadline is not None:
            wait_s = min(wait_s, deadline - time.monotonic())
            if wait_s <= 0:
                raise TimeoutError("Timed out waiting on the shared-memory ring.")
        if not poller.poll(wait_s * 1000) and idle_check is not None:
            idle_check()


async def _wait_async(ready: Callable[[], bool], fd: int) -> None:
    import trio

    deadline = time.perf_counter() + SPIN_S
    while time.perf_counter() < deadline:
        if ready():
            return
        await trio.lowlevel.checkpoint()
    while True:
        _drain(fd)
        if ready():
            return
        await trio.lowlevel.wait_readable(fd)


class RingWriter:
    """The single writer of a ring. ``send`` (Trio) and ``send_sync`` (plain process)."""

    def __init__(
        self,
        ring: ShmRing,
        fds: RingFds,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        if len(fds.data_fds) != ring.num_readers:
            raise ValueError(f"{len(fds.data_fds)} data fds for {ring.num_readers} readers.")
        self.ring = ring
        self.fds = fds
        self.max_message_size = max_message_size
        self._next = ring.write_count

    def _has_space(self) -> bool:
        if self.ring.closed:
            return True  # the next _write_chunk raises RingClosedError
        return self._next - int(self.ring.read_counts.min()) < self.ring.num_slots

    def _write_chunk(self, payload: memoryview, flags: int) -> None:
        ring = self.ring
        if ring.closed:
            raise RingClosedError(f"Ring {ring.name} is closed.")
        off = ring.slot_offset(self._next)
        n = len(payload)
        start = off + SLOT_HEADER_SIZE
        ring.buf[start : start + n] = payload
        SLOT_HEADER.pack_into(ring.buf, off, self._next, n, flags, zlib.crc32(payload), SLOT_MAGIC)
        self._next += 1
        ring.publish(self._next)  # after the slot is complete
        for fd in self.fds.data_fds:
            _signal(fd)

    def _chunks(self, data: bytes) -> list[tuple[memoryview, int]]:
        if len(data) > self.max_message_size:
            raise MessageTooLargeError(
                f"Message of {len(data)} bytes exceeds the ring's limit of "
                f"{self.max_message_size} bytes."
            )
        view, size = memoryview(data), self.ring.slot_size
        starts = range(0, max(len(data), 1), size)
        last = len(starts) - 1
        return [
            (view[s : s + size], (FIRST if i == 0 else 0) | (LAST if i == last else 0))
            for i, s in enumerate(starts)
        ]

    def send_sync(
        self,
        data: bytes,
        timeout: float | None = None,
        idle_check: Callable[[], None] | None = None,
    ) -> None:
        for payload, flags in self._chunks(data):
            if not self._has_space():
                _wait_sync(self._has_space, self.fds.space_fd, timeout, idle_check)
            self._write_chunk(payload, flags)

    async def send(self, data: bytes) -> None:
        import trio

        await trio.lowlevel.checkpoint_if_cancelled()
        for payload, flags in self._chunks(data):
            if not self._has_space():
                await _wait_async(self._has_space, self.fds.space_fd)
            self._write_chunk(payload, flags)

    def close(self) -> None:
        """Mark the ring closed and wake every reader (they raise once drained)."""
        self.ring.mark_closed()
        for fd in self.fds.data_fds:
            _signal(fd)


class RingReader:
    """Reader ``index`` of a ring. ``recv`` (Trio) and ``recv_sync`` (plain process)."""

    def __init__(
        self,
        ring: ShmRing,
        index: int,
        fds: RingFds,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        if not 0 <= index < ring.num_readers:
            raise ValueError(f"Reader index {index} out of range [0, {ring.num_readers}).")
        self.ring = ring
        self.index = index
        self.data_fd = fds.data_fds[index]
        self.space_fd = fds.space_fd
        self.max_message_size = max_message_size
        self._next = int(ring.read_counts[index])
        # Chunks of a message being reassembled; kept here so a cancelled recv can resume.
        self._parts: list[bytes] = []
        self._size = 0

    def _has_data(self) -> bool:
        return self.ring.write_count > self._next or self.ring.closed

    def _read_chunk(self) -> tuple[bytes, int]:
        """Consume chunk ``_next`` (``_has_data()`` was true)."""
        ring = self.ring
        if ring.write_count <= self._next:
            raise RingClosedError(f"Ring {ring.name} is closed.")
        off = ring.slot_offset(self._next)
        seq, n, flags, crc, magic = SLOT_HEADER.unpack_from(ring.buf, off)
        where = f"ring {ring.name} slot {self._next % ring.num_slots} (chunk {self._next})"
        if magic != SLOT_MAGIC or seq != self._next:
            raise RingCorruptError(f"Corrupt {where}: magic {magic:#x}, sequence {seq}.")
        if n > ring.slot_size or flags & ~(FIRST | LAST):
            raise RingCorruptError(f"Corrupt {where}: length {n}, flags {flags:#x}.")
        start = off + SLOT_HEADER_SIZE
        data = bytes(ring.buf[start : start + n])
        if zlib.crc32(data) != crc:
            raise RingCorruptError(f"Corrupt {where}: checksum mismatch.")
        self._next += 1
        ring.read_counts[self.index] = self._next
        _signal(self.space_fd)
        return data, flags

    def _add(self, data: bytes, flags: int) -> bytes | None:
        """Append a chunk; the whole message once its LAST chunk is in."""
        if bool(flags & FIRST) == bool(self._parts):
            raise RingCorruptError(
                f"Corrupt ring {self.ring.name}: chunk {self._next - 1} breaks message framing."
            )
        self._parts.append(data)
        self._size += len(data)
        if self._size > self.max_message_size:
            raise RingCorruptError(
                f"Corrupt ring {self.ring.name}: message exceeds {self.max_message_size} bytes."
            )
        if not flags & LAST:
            return None
        message = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts, self._size = [], 0
        return message

    def try_recv(self) -> bytes | None:
        """A whole message if one is fully published, else None (never waits)."""
        while self.ring.write_count > self._next:
            message = self._add(*self._read_chunk())
            if message is not None:
                return message
        return None

    def recv_sync(
        self,
        timeout: float | None = None,
        idle_check: Callable[[], None] | None = None,
    ) -> bytes:
        while True:
            if not self._has_data():
                _wait_sync(self._has_data, self.data_fd, timeout, idle_check)
            message = self._add(*self._read_chunk())
            if message is not None:
                return message

    async def recv(self) -> bytes:
        import trio

        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if not self._has_data():
                await _wait_async(self._has_data, self.data_fd)
            message = self._add(*self._read_chunk())
            if message is not None:
                return message
