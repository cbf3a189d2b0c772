"""The P2P connector's decode side ends with its engine: once an in-process engine shut down,
its push listener's port is free and none of the connector's threads (the listener's, its
peers', the fetch pool's) is left. Failed transfers and pushes are one warning line per
interval with the running count, not one per request."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from kv_connectors import kv_engine
from server_harness import free_port

from trillm import SamplingParams
from trillm.kv_transfer import p2p_recv, p2p_wire
from trillm.kv_transfer.log_every import EveryWarning
from trillm.kv_transfer.p2p_push import Pusher, push
from trillm.kv_transfer.p2p_recv import Receiver

PROMPT = {"prompt_token_ids": list(range(5, 45))}  # 2 whole blocks before the last token
KEY = "ab" * 20


def _connector_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("trillm-kv-p2p")}


def _consumer_kv(send_type: str, prefill: int, decode: int) -> dict:
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_role": "kv_consumer",
        "kv_port": decode,
        "kv_connector_extra_config": {
            "send_type": send_type,
            "prefill_kv_addrs": [f"127.0.0.1:{prefill}"],
        },
    }


@pytest.mark.parametrize("send_type", ["GET", "PUT"])
def test_the_decode_side_closes_with_its_engine(tiny_model_factory, monkeypatch, send_type):
    """A request whose KV never comes (nothing listens at the prefill address, nothing is
    pushed) and, in PUT, a push from a listed sender: while the engine runs its connector's
    threads run (and its listener takes the push); after ``shutdown`` its port can be bound
    again and no connector thread is left."""
    monkeypatch.setattr(p2p_recv, "PUSH_WAIT_S", 0.2)
    before = _connector_threads()
    prefill, decode = free_port(), free_port()
    engine = kv_engine(
        tiny_model_factory("qwen2"), kv_transfer_config=_consumer_kv(send_type, prefill, decode)
    )
    try:
        rid = f"___prefill_addr_127.0.0.1:{prefill}___decode_addr_127.0.0.1:{decode}_0"
        params = SamplingParams(temperature=0.0, max_tokens=2)
        engine.generate([PROMPT], params, use_tqdm=False)  # warm: engine threads started

        async def generate() -> None:
            async with engine.engine.generate_many([PROMPT], [params], [rid]) as items:
                async for _ in items:
                    pass

        engine._call(generate)
        if send_type == "PUT":
            assert push("127.0.0.1", decode, KEY, b"x" * 100)  # kept in its pool
        assert _connector_threads() - before  # the listener's or the fetch pool's
    finally:
        engine.shutdown()
    assert not {t for t in _connector_threads() - before if t.is_alive()}
    p2p_wire.listen("127.0.0.1", decode).close()  # NOTE: fails while the listener is open


def test_a_closed_listener_drops_a_silent_peer_and_joins_its_threads():
    store = p2p_wire.SendStore(1000)
    before = _connector_threads()
    server = p2p_wire.KVServer(store, "127.0.0.1", 0)
    with socket.create_connection(server.address) as silent:  # sends nothing
        deadline = time.monotonic() + 5
        while len(_connector_threads() - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the accept thread and the silent peer's
        assert len(_connector_threads() - before) == 2
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 2  # not the peer's 10 s deadline
        assert silent.recv(1) == b""  # dropped
    assert not _connector_threads() - before


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_closed_receiver_ends_a_stalled_fetch_at_once(world_size):
    """The prefill instance answers a 500 MB length and sends nothing more (a payload
    deadline of 11 s): ``close`` (the engine's shutdown) ends the fetch at once, and no fetch
    thread is left."""
    before = _connector_threads()
    answered, asked = threading.Event(), []
    with socket.create_server(("127.0.0.1", 0)) as server:

        def stall() -> None:
            conn, _ = server.accept()
            with conn:
                asked.append(conn.recv(100))
                conn.sendall((500_000_000).to_bytes(8, "little"))
                answered.set()
                conn.recv(1)  # until the fetch's side closes

        peer = threading.Thread(target=stall, daemon=True)
        peer.start()
        port = server.getsockname()[1]
        receiver = Receiver(10**9, world_size=world_size)
        try:
            assert receiver.want("r", f"127.0.0.1:{port}/{KEY}")
            assert answered.wait(5)
            time.sleep(0.2)  # in the payload's read
        finally:
            start = time.monotonic()
            receiver.close()
            took = time.monotonic() - start
        peer.join(5)
    assert took < 1.0
    assert asked == [f"GET {KEY}\n".encode()]
    assert receiver.finished() == [] and receiver.take("r") is None
    assert not {t for t in _connector_threads() - before if t.is_alive()}


def test_an_engine_stops_at_once_while_a_fetch_stalls(tiny_model_factory):
    """A decode engine whose request's prefill instance answers a 500 MB length, then nothing:
    the engine, left while the request waits, stops within seconds, not at the fetch's
    deadline (its receiver's close runs off the loop and ends the fetch), and leaves no
    connector thread."""
    import trio

    from trillm import open_engine

    before = _connector_threads()
    answered = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:

        def stall() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(100)
                conn.sendall((500_000_000).to_bytes(8, "little"))
                answered.set()
                conn.recv(1)

        threading.Thread(target=stall, daemon=True).start()
        prefill, decode = server.getsockname()[1], free_port()
        rid = f"___prefill_addr_127.0.0.1:{prefill}___decode_addr_127.0.0.1:{decode}_0"
        params = SamplingParams(temperature=0.0, max_tokens=2)
        took: list[float] = []

        async def main() -> None:
            async with open_engine(
                tiny_model_factory("qwen2"),
                distributed_executor_backend="uni",
                max_model_len=256,
                kv_cache_memory="8MiB",
                kv_transfer_config=_consumer_kv("GET", prefill, decode),
            ) as engine:

                async def generate() -> None:
                    async with engine.generate_many([PROMPT], [params], [rid]) as items:
                        async for _ in items:
                            pass

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(generate)
                    with trio.fail_after(10):
                        while not answered.is_set():
                            await trio.sleep(0.01)
                    await trio.sleep(0.2)  # in the payload's read
                    nursery.cancel_scope.cancel()
                start = time.monotonic()
            took.append(time.monotonic() - start)

        trio.run(main)
    assert took[0] < 3  # (10 s before: the fetch's payload deadline)
    assert not {t for t in _connector_threads() - before if t.is_alive()}


def test_failed_transfers_are_one_warning_per_interval(caplog):
    """Five requests naming a listed prefill instance that is gone: five failures, counted,
    one warning line (the others at debug level); past the interval, a line again."""
    gone = f"127.0.0.1:{free_port()}"
    receiver = Receiver(10_000)
    try:
        with caplog.at_level(logging.DEBUG, logger="trillm.kv_transfer"):
            for i in range(5):
                assert receiver.want(f"r{i}", f"{gone}/{KEY}")
            deadline = time.monotonic() + 10
            while receiver.failures < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
                receiver.finished()
    finally:
        receiver.close()
    assert receiver.failures == 5
    lines = [r for r in caplog.records if "KV transfer failed" in r.getMessage()]
    assert [r.levelno for r in lines].count(logging.WARNING) == 1
    assert [r.levelno for r in lines].count(logging.DEBUG) == 4
    assert "(1 transfer failures so far, 0 not logged since the last line)" in caplog.text
    assert lines[0].filename == "p2p_recv.py"  # the caller's line, not the helper's


def test_the_warning_counts_what_it_did_not_log(caplog):
    warning = EveryWarning(logging.getLogger("trillm.test_every"), "misses", every_s=0.2)
    with caplog.at_level(logging.DEBUG, logger="trillm.test_every"):
        assert warning.warn("miss %d", 1)
        assert not warning.warn("miss %d", 2)
        assert not warning.warn("miss %d", 3)
        time.sleep(0.25)
        assert warning.warn("miss %d", 4)
    loud = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert loud == [
        "miss 1 (1 misses so far, 0 not logged since the last line)",
        "miss 4 (4 misses so far, 2 not logged since the last line)",
    ]
    assert warning.count == 4


def test_failed_pushes_are_one_warning_per_interval(caplog):
    pusher = Pusher(asynchronous=False, queue_bytes=1000)
    gone = f"127.0.0.1:{free_port()}"
    for _ in range(3):
        pusher.send(gone, KEY, b"x" * 10)  # "PUT": in the caller, refused at once
    assert pusher.failed == 3
    assert caplog.text.count(f"KV push to {gone} failed") == 1
    assert "(1 pushes not sent so far" in caplog.text
