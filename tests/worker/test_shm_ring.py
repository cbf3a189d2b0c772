"""The shared-memory ring: real segments, real eventfds, readers in real subprocesses."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
import trio.testing

from trillm.errors import MessageTooLargeError, RingClosedError, RingCorruptError
from trillm.ipc.shm_ring import RingReader, RingWriter
from trillm.ipc.shm_segment import RingFds, ShmRing

ROOT = Path(__file__).resolve().parents[2]

# A reader process: attaches as reader `index`, receives `count` messages, prints
# {"count": n, "digest": sha256 over (len, bytes) of every message}.
READER = textwrap.dedent(
    """
    import hashlib, json, sys
    from trillm.ipc.shm_ring import RingReader
    from trillm.ipc.shm_segment import RingFds, ShmRing
    fds = RingFds(**json.loads(sys.argv[1]))
    index, count = int(sys.argv[2]), int(sys.argv[3])
    reader = RingReader(ShmRing.attach(fds.name), index, fds)
    h = hashlib.sha256()
    for _ in range(count):
        m = reader.recv_sync(timeout=30)
        h.update(len(m).to_bytes(8, "little")); h.update(m)
    print(json.dumps({"count": count, "digest": h.hexdigest()}))
    """
)

# A writer process: attaches, sleeps a little (the reader is asleep on its eventfd by then),
# sends argv[2] as one message.
WRITER = textwrap.dedent(
    """
    import json, sys, time
    from trillm.ipc.shm_ring import RingWriter
    from trillm.ipc.shm_segment import RingFds, ShmRing
    fds = RingFds(**json.loads(sys.argv[1]))
    writer = RingWriter(ShmRing.attach(fds.name), fds)
    time.sleep(0.3)
    writer.send_sync(sys.argv[2].encode(), timeout=30)
    """
)


class Ring:
    """A ring with its eventfds; unlinked and closed at the end of the test."""

    def __init__(self, num_readers: int, num_slots: int, slot_size: int) -> None:
        self.shm = ShmRing.create(num_readers, num_slots, slot_size)
        self.fds = RingFds.create(self.shm.name, num_readers)

    def writer(self, **kw) -> RingWriter:
        return RingWriter(self.shm, self.fds, **kw)

    def reader(self, index: int = 0, **kw) -> RingReader:
        return RingReader(self.shm, index, self.fds, **kw)

    def spawn(self, script: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-c", script, json.dumps(self.fds_dict()), *args]
        return subprocess.Popen(
            argv, pass_fds=self.fds.all_fds(), stdout=subprocess.PIPE, text=True, env=env
        )

    def fds_dict(self) -> dict:
        return {"name": self.fds.name, "data_fds": self.fds.data_fds, "space_fd": self.fds.space_fd}

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()
        self.fds.close()


@pytest.fixture
def make_ring():
    rings: list[Ring] = []

    def make(num_readers: int = 1, num_slots: int = 4, slot_size: int = 256) -> Ring:
        rings.append(Ring(num_readers, num_slots, slot_size))
        return rings[-1]

    yield make
    for ring in rings:
        name = ring.shm.name
        ring.close()
        assert not os.path.exists(f"/dev/shm/{name}")


def digest(messages: list[bytes]) -> str:
    h = hashlib.sha256()
    for m in messages:
        h.update(len(m).to_bytes(8, "little"))
        h.update(m)
    return h.hexdigest()


def random_messages(count: int, max_size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [
        rng.randbytes(rng.choice([0, 1, 7, 100, 255, 256, 257, max_size])) for _ in range(count)
    ]


def test_round_trip_one_reader(make_ring):
    ring = make_ring()
    writer, reader = ring.writer(), ring.reader()
    assert reader.try_recv() is None
    for message in (b"hello", b"", b"x" * 256):
        writer.send_sync(message)
        assert reader.recv_sync(timeout=5) == message
    assert reader.try_recv() is None


@pytest.mark.parametrize("num_readers", [1, 3])
def test_reader_processes_wraparound_and_split_messages(make_ring, num_readers):
    # 4 slots of 256 bytes, 300 messages up to 3000 bytes: many wraparounds, messages split over
    # more chunks than there are slots, and the writer constantly waits on slow readers.
    ring = make_ring(num_readers=num_readers, num_slots=4, slot_size=256)
    messages = random_messages(300, 3000, seed=num_readers)
    procs = [ring.spawn(READER, str(i), str(len(messages))) for i in range(num_readers)]
    writer = ring.writer()

    async def send_all() -> None:
        with trio.fail_after(60):
            for m in messages:
                await writer.send(m)

    trio.run(send_all)
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert json.loads(out) == {"count": len(messages), "digest": digest(messages)}


def test_backpressure_sync(make_ring):
    ring = make_ring(num_slots=2, slot_size=64)
    writer, reader = ring.writer(), ring.reader()
    writer.send_sync(b"a")
    writer.send_sync(b"b")
    with pytest.raises(TimeoutError):
        writer.send_sync(b"c", timeout=0.2)  # both slots unread
    assert reader.recv_sync(timeout=5) == b"a"
    writer.send_sync(b"c", timeout=5)
    assert [reader.recv_sync(timeout=5) for _ in range(2)] == [b"b", b"c"]


def test_backpressure_waits_for_the_slowest_reader(make_ring):
    ring = make_ring(num_readers=2, num_slots=2, slot_size=64)
    writer, fast, slow = ring.writer(), ring.reader(0), ring.reader(1)
    writer.send_sync(b"1")
    writer.send_sync(b"2")
    assert [fast.recv_sync(timeout=5) for _ in range(2)] == [b"1", b"2"]
    with pytest.raises(TimeoutError):
        writer.send_sync(b"3", timeout=0.2)
    assert slow.recv_sync(timeout=5) == b"1"
    writer.send_sync(b"3", timeout=5)
    assert [slow.recv_sync(timeout=5) for _ in range(2)] == [b"2", b"3"]
    assert fast.recv_sync(timeout=5) == b"3"


def test_async_writer_blocks_until_reader_frees_a_slot(make_ring):
    ring = make_ring(num_slots=2, slot_size=64)
    writer, reader = ring.writer(), ring.reader()
    events: list[str] = []

    async def main() -> None:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:

                async def write() -> None:
                    for m in (b"a", b"b", b"c"):
                        await writer.send(m)
                        events.append(f"sent {m.decode()}")

                nursery.start_soon(write)
                await trio.sleep(0.2)
                assert events == ["sent a", "sent b"]  # "c" waits for a free slot
                assert await reader.recv() == b"a"
                assert await reader.recv() == b"b"
                assert await reader.recv() == b"c"

    trio.run(main)
    assert events == ["sent a", "sent b", "sent c"]


def test_message_larger_than_the_whole_ring(make_ring):
    ring = make_ring(num_slots=2, slot_size=100)
    writer, reader = ring.writer(), ring.reader()
    big = random.Random(1).randbytes(10_000)  # 100 chunks through 2 slots
    received: list[bytes] = []

    async def main() -> None:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer.send, big)
                received.append(await reader.recv())

    trio.run(main)
    assert received == [big]


def test_message_too_large_is_rejected(make_ring):
    ring = make_ring()
    writer = ring.writer(max_message_size=1000)
    with pytest.raises(MessageTooLargeError, match="1001 bytes exceeds the ring's limit of 1000"):
        writer.send_sync(b"x" * 1001)
    writer.send_sync(b"x" * 1000)
    assert ring.reader().recv_sync(timeout=5) == b"x" * 1000


def slot_header_offset(ring: Ring, seq: int) -> int:
    return ring.shm.slot_offset(seq)


def test_corrupt_payload_is_detected(make_ring):
    ring = make_ring()
    ring.writer().send_sync(b"payload")
    payload_at = slot_header_offset(ring, 0) + 32
    ring.shm.buf[payload_at] ^= 0xFF
    with pytest.raises(RingCorruptError, match="checksum mismatch"):
        ring.reader().recv_sync(timeout=5)


def test_corrupt_length_is_detected_without_reading_out_of_bounds(make_ring):
    ring = make_ring(slot_size=256)
    ring.writer().send_sync(b"payload")
    at = slot_header_offset(ring, 0) + 8  # seq u64, then length u32
    ring.shm.buf[at : at + 4] = (10**9).to_bytes(4, "little")
    with pytest.raises(RingCorruptError, match="length 1000000000"):
        ring.reader().recv_sync(timeout=5)


def test_corrupt_sequence_is_detected(make_ring):
    ring = make_ring()
    ring.writer().send_sync(b"payload")
    at = slot_header_offset(ring, 0)
    ring.shm.buf[at : at + 8] = (5).to_bytes(8, "little")
    with pytest.raises(RingCorruptError, match="sequence 5"):
        ring.reader().recv_sync(timeout=5)


def test_broken_framing_is_detected(make_ring):
    ring = make_ring(slot_size=16)
    ring.writer().send_sync(b"x" * 40)  # chunks FIRST, -, LAST
    reader = ring.reader()
    flags_at = slot_header_offset(ring, 0) + 12
    ring.shm.buf[flags_at : flags_at + 4] = (0).to_bytes(4, "little")  # drop FIRST
    with pytest.raises(RingCorruptError, match="breaks message framing"):
        reader.recv_sync(timeout=5)


def test_attach_rejects_a_foreign_segment():
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        with pytest.raises(RingCorruptError, match="not a trillm ring"):
            ShmRing.attach(shm.name)
    finally:
        shm.close()
        shm.unlink()


def test_closed_ring_drains_then_raises(make_ring):
    ring = make_ring()
    writer, reader = ring.writer(), ring.reader()
    writer.send_sync(b"last")
    writer.close()
    assert reader.recv_sync(timeout=5) == b"last"
    with pytest.raises(RingClosedError):
        reader.recv_sync(timeout=5)
    with pytest.raises(RingClosedError):
        writer.send_sync(b"more")


def test_trio_reader_sleeping_on_eventfd_is_woken_by_another_process(make_ring):
    ring = make_ring()
    reader = ring.reader()
    proc = ring.spawn(WRITER, "wake up")
    got: list[bytes] = []

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                ticks = 0

                async def ticker() -> None:  # the loop keeps running while the reader sleeps
                    nonlocal ticks
                    while True:
                        ticks += 1
                        await trio.sleep(0.01)

                nursery.start_soon(ticker)
                got.append(await reader.recv())
                nursery.cancel_scope.cancel()
        assert ticks > 5

    trio.run(main)
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert got == [b"wake up"]


def test_partial_message_survives_across_calls(make_ring):
    # A recv that is cancelled (or a try_recv that returns None) mid-message keeps the chunks
    # it consumed; the next call completes the same message.
    ring = make_ring(num_slots=2, slot_size=10)
    writer, reader = ring.writer(), ring.reader()
    big = bytes(range(50))  # 5 chunks through 2 slots

    async def main() -> None:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer.send, big)
                await trio.testing.wait_all_tasks_blocked()  # the writer waits after 2 chunks
                assert reader.try_recv() is None  # consumed chunks 0 and 1, message incomplete
                await trio.testing.wait_all_tasks_blocked()
                got = None
                with trio.move_on_after(0.001):
                    got = await reader.recv()  # may consume more chunks, then be cancelled
                if got is None:
                    got = await reader.recv()
                assert got == big
                assert reader.try_recv() is None

    trio.run(main)
