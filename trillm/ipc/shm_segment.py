"""A shared-memory ring's segment: its memory layout, its lifetime (create, attach, close,
unlink) and the eventfds that go with it (``RingFds``). Linux only. The protocol over it (one
writer, N readers, chunked messages, waiting) is ``trillm.ipc.shm_ring``.

Layout of the segment (little-endian; every counter on its own 64-byte line):

    [0, 64)                 header: magic u64, version u32, num_slots u32, slot_size u32,
                            num_readers u32
    [64, 128)               write_count i64: chunks published so far
    [128, 192)              closed i64: 1 once the ring is closed
    [192 + 64 r, ...)       read_count[r] i64: chunks reader r has consumed
    slots                   num_slots x (32-byte slot header + slot_size payload bytes)

Slot header: seq u64 (the chunk's index), length u32, flags u32 (FIRST/LAST), crc32 u32,
magic u32. Chunk ``k`` lives in slot ``k % num_slots``.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from trillm.errors import RingCorruptError

MAGIC = 0x474E49524D4C5254  # b"TRLMRING"
VERSION = 1
SLOT_MAGIC = 0x544F4C53  # b"SLOT"
FIRST, LAST = 1, 2
DEFAULT_NUM_SLOTS = 8
DEFAULT_SLOT_SIZE = 1 << 20

_LINE = 64
_HEADER = struct.Struct("<QIIII")
SLOT_HEADER = struct.Struct("<QIIII")
SLOT_HEADER_SIZE = 32
_WRITE, _CLOSED, _READ0 = 0, 1, 2  # counter lines
_I64_PER_LINE = _LINE // 8


def _align(n: int) -> int:
    return (n + _LINE - 1) // _LINE * _LINE


def _layout(num_readers: int, num_slots: int, slot_size: int) -> tuple[int, int, int]:
    """-> (slots_offset, slot_stride, total_size)."""
    slots_offset = _LINE * (1 + _READ0 + num_readers)
    stride = _align(SLOT_HEADER_SIZE + slot_size)
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

    def publish(self, write_count: int) -> None:
        """Store ``write_count`` (the writer, once the slots it counts are complete)."""
        self.counters[_WRITE * _I64_PER_LINE] = write_count

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
