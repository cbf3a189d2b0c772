"""A shared-memory ring: one writer, N readers, eventfd wake-ups. Linux only.

Layout of the segment (little-endian; every counter on its own 64-byte line):

    [0, 64)                 header: magic u64, version u32, num_slots u32, slot_size u32,
                            num_readers u32
    [64, 128)               write_count i64: chunks published so far
    [128, 192)              closed i64: 1 once the ring is closed
    [192 + 64 r, ...)       read_count[r] i64: chunks reader r has consumed
    slots                   num_slots x (32-byte slot header + slot_size payload bytes)

Slot header: seq u64 (the chunk's index), length u32, flags u32 (FIRST/LAST), crc32 u32,
magic u32. Chunk ``k`` lives in slot ``k % num_slots``.

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

import mmap
import os
import select
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from trillm.errors import MessageTooLargeError, RingClosedError, RingCorruptError

MAGIC = 0x474E49524D4C5254  # b"TRLMRING"
VERSION = 1
SLOT_MAGIC = 0x544F4C53  # b"SLOT"
FIRST, LAST = 1, 2
DEFAULT_NUM_SLOTS = 8
DEFAULT_SLOT_SIZE = 1 << 20
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30
SPIN_S = 50e-6
POLL_INTERVAL_S = 0.5

_LINE = 64
_HEADER = struct.Struct("<QIIII")
_SLOT_HEADER = struct.Struct("<QIIII")
_SLOT_HEADER_SIZE = 32
_WRITE, _CLOSED, _READ0 = 0, 1, 2  # counter lines
_I64_PER_LINE = _LINE // 8


def _align(n: int) -> int:
    return (n + _LINE - 1) // _LINE * _LINE


def _layout(num_readers: int, num_slots: int, slot_size: int) -> tuple[int, int, int]:
    """-> (slots_offset, slot_stride, total_size)."""
    slots_offset = _LINE * (1 + _READ0 + num_readers)
    stride = _align(_SLOT_HEADER_SIZE + slot_size)
    return slots_offset, stride, slots_offset + stride * num_slots


class ShmRing:
    """The mapped segment; ``RingWriter`` and ``RingReader`` do the protocol over it."""

    def __init__(self, name: str, mm: mmap.mmap, shm: shared_memory.SharedMemory | None) -> None:
        self.name = name
        self._mmap = mm
        self._shm = shm  # the creator's handle: owns unlink (and the resource-tracker safety net)
        self.buf = memoryview(mm)
        magic, version, self.num_slots, self.slot_size, self.num_readers = _HEADER.unpack_from(
            self.buf, 0
        )
        if magic != MAGIC or version != VERSION:
            self.buf.release()
            raise RingCorruptError(f"/dev/shm/{name} is not a trillm ring (bad magic/version).")
        self.slots_offset, self.slot_stride, size = _layout(
            self.num_readers, self.num_slots, self.slot_size
        )
        if len(self.buf) < size:
            self.buf.release()
            raise RingCorruptError(f"/dev/shm/{name} is {len(mm)} bytes, expected {size}.")
        lines = _READ0 + self.num_readers
        # counters[line * 8]: one int64 per 64-byte line
        self.counters = np.frombuffer(self.buf, np.int64, lines * _I64_PER_LINE, _LINE)
        self.read_counts = self.counters[_READ0 * _I64_PER_LINE :: _I64_PER_LINE]

    @classmethod
    def create(
        cls,
        num_readers: int,
        num_slots: int = DEFAULT_NUM_SLOTS,
        slot_size: int = DEFAULT_SLOT_SIZE,
    ) -> ShmRing:
        if num_readers < 1 or num_slots < 1 or slot_size < 1:
            raise ValueError("A ring needs at least one reader, one slot and a positive size.")
        size = _layout(num_readers, num_slots, slot_size)[2]
        shm = shared_memory.SharedMemory(create=True, size=size)
        fd = os.open(f"/dev/shm/{shm.name}", os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEADER.pack_into(mm, 0, MAGIC, VERSION, num_slots, slot_size, num_readers)
        return cls(shm.name, mm, shm)

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        """Map an existing ring (another process created it); this side never unlinks it."""
        # NOTE: plain mmap, not SharedMemory(name): on Python < 3.13 that would register the
        # segment with this process's resource tracker, which unlinks it when we exit.
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mm, None)

    @property
    def write_count(self) -> int:
        return int(self.counters[_WRITE * _I64_PER_LINE])

    @property
    def closed(self) -> bool:
        return bool(self.counters[_CLOSED * _I64_PER_LINE])

    def mark_closed(self) -> None:
        """Waiting peers wake up (once signalled) and raise ``RingClosedError``."""
        self.counters[_CLOSED * _I64_PER_LINE] = 1

    def slot_offset(self, seq: int) -> int:
        return self.slots_offset + (seq % self.num_slots) * self.slot_stride

    def close(self) -> None:
        """Unmap (idempotent). Views handed out by this object become invalid."""
        if self._mmap.closed:
            return
        del self.counters, self.read_counts
        self.buf.release()
        self._mmap.close()
        if self._shm is not None:
            self._shm.close()

    def unlink(self) -> None:
        """Remove the segment from /dev/shm (creator only; idempotent)."""
        if self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass


@dataclass(slots=True)
class RingFds:
    """What a process needs to join a ring; plain data (it travels on a worker's argv)."""

    name: str
    data_fds: list[int]  # one eventfd per reader: the writer signals "a chunk was published"
    space_fd: int  # the readers signal "a slot was freed"

    @classmethod
    def create(cls, name: str, num_readers: int) -> RingFds:
        flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
        return cls(name, [os.eventfd(0, flags) for _ in range(num_readers)], os.eventfd(0, flags))

    def all_fds(self) -> list[int]:
        return [*self.data_fds, self.space_fd]

    def close(self) -> None:
        for fd in self.all_fds():
            try:
                os.close(fd)
            except OSError:
                pass


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
        start = off + _SLOT_HEADER_SIZE
        ring.buf[start : start + n] = payload
        _SLOT_HEADER.pack_into(ring.buf, off, self._next, n, flags, zlib.crc32(payload), SLOT_MAGIC)
        self._next += 1
        ring.counters[_WRITE * _I64_PER_LINE] = self._next  # publish after the slot is complete
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
        seq, n, flags, crc, magic = _SLOT_HEADER.unpack_from(ring.buf, off)
        where = f"ring {ring.name} slot {self._next % ring.num_slots} (chunk {self._next})"
        if magic != SLOT_MAGIC or seq != self._next:
            raise RingCorruptError(f"Corrupt {where}: magic {magic:#x}, sequence {seq}.")
        if n > ring.slot_size or flags & ~(FIRST | LAST):
            raise RingCorruptError(f"Corrupt {where}: length {n}, flags {flags:#x}.")
        start = off + _SLOT_HEADER_SIZE
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
