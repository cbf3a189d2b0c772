"""vLLM's P2pNcclConnector push modes over TCP (send_type "PUT": the prefill instance pushes a
prompt's KV inside its step; "PUT_ASYNC", vLLM's default: from a background thread): the
decode instance's greedy tokens and logprobs equal one plain instance's and every pushed whole
block is loaded, not computed; a push that never comes is recomputed after a bounded wait; the
prefill pushes only to the decode addresses its operator lists, the decode instance takes
pushes only from its listed prefill IPs, each sender within its share of the pool
(``mem_pool_size_gb``), and evicts what nobody claims."""

from __future__ import annotations

import socket
import time

import pytest
from kv_connectors import aligned, kv_engine, max_logprob_diff
from server_harness import free_port

from trillm import LLM, SamplingParams
from trillm.kv_transfer import p2p_push, p2p_recv
from trillm.kv_transfer.config import parse_kv_transfer_config
from trillm.kv_transfer.p2p_push import Pusher, PushPool, PushServer, push

LENGTHS = (40, 17, 70, 9)  # 2, 1, 4 and 0 whole blocks before the last prompt token
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
KEY = "ab" * 20


def _kv(role: str, send_type: str, prefill: int, decode: int, **extra) -> dict:
    """A producer pushing to the decode port; a consumer listening on it, taking pushes from
    the prefill instance (``prefill``: the port its request ids name)."""
    if role == "kv_consumer":
        extra.setdefault("prefill_kv_addrs", [f"127.0.0.1:{prefill}"])
    else:
        extra.setdefault("decode_kv_addrs", [f"127.0.0.1:{decode}"])
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_role": role,
        "kv_port": str(prefill if role == "kv_producer" else decode),
        # vLLM's push examples: a producer's buffer of 10 bytes (its "GET" store's size)
        "kv_buffer_size": "1e1" if role == "kv_producer" else "1e9",
        "kv_connector_extra_config": {"send_type": send_type, **extra},
    }


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": list(range(5 + i, 5 + i + n))} for i, n in enumerate(LENGTHS)]


def _ids(prefill: int, decode: int) -> list[str]:
    return [
        f"___prefill_addr_127.0.0.1:{prefill}___decode_addr_127.0.0.1:{decode}_{i}"
        for i in range(len(LENGTHS))
    ]


def _run(engine: LLM, ids: list[str], params: SamplingParams = PARAMS) -> list:
    async def generate() -> list:
        outs: list = [None] * len(ids)
        async with engine.engine.generate_many(_prompts(), [params] * len(ids), ids) as items:
            async for index, out in items:
                outs[index] = out
        return outs

    try:
        return engine._call(generate)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    return path, _run(kv_engine(path), [f"plain-{i}" for i in range(len(LENGTHS))])


@pytest.mark.parametrize("send_type", ["PUT", "PUT_ASYNC"])
def test_the_prefill_instance_pushes_and_the_decode_matches(plain, send_type):
    path, reference = plain
    prefill, decode = free_port(), free_port()
    ids = _ids(prefill, decode)
    consumer = kv_engine(path, kv_transfer_config=_kv("kv_consumer", send_type, prefill, decode))
    producer = kv_engine(path, kv_transfer_config=_kv("kv_producer", send_type, prefill, decode))
    _run(producer, ids, SamplingParams(max_tokens=1))
    outs = _run(consumer, ids)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    # every whole block before the last prompt token was pushed, none was computed
    assert [o.num_cached_tokens for o in outs] == [aligned(n) for n in LENGTHS]
    assert max_logprob_diff(outs, reference) < 1e-4


def test_a_push_that_never_comes_is_recomputed(plain, monkeypatch, caplog):
    path, reference = plain
    monkeypatch.setattr(p2p_recv, "PUSH_WAIT_S", 0.5)
    prefill, decode = free_port(), free_port()
    consumer = kv_engine(path, kv_transfer_config=_kv("kv_consumer", "PUT", prefill, decode))
    start = time.monotonic()
    outs = _run(consumer, _ids(prefill, decode))
    assert time.monotonic() - start < 30
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    assert [o.num_cached_tokens for o in outs] == [0] * len(LENGTHS)
    assert max_logprob_diff(outs, reference) < 1e-4
    assert caplog.text.count("KV transfer failed") == 1  # the three: one line per 10 s


def test_the_prefill_pushes_only_to_listed_decode_addresses(plain, caplog):
    """Request ids naming a decode address the producer does not list (a client can set the
    request id): nothing is pushed there, the named port sees no connection."""
    path, _ = plain
    prefill, listed = free_port(), free_port()
    with socket.create_server(("127.0.0.1", 0)) as trap:
        trap.setblocking(False)
        kv = _kv("kv_producer", "PUT", prefill, listed)
        _run(
            kv_engine(path, kv_transfer_config=kv),
            _ids(prefill, trap.getsockname()[1]),
            SamplingParams(max_tokens=1),
        )
        with pytest.raises(BlockingIOError):  # no connection is waiting to be accepted
            trap.accept()
    assert "not in kv_connector_extra_config.decode_kv_addrs" in caplog.text


def test_the_pool_takes_listed_senders_only_within_their_share(monkeypatch):
    pool = PushPool(3000, frozenset({"127.0.0.1", "10.0.0.9"}))  # a share: 1,500 bytes
    server = PushServer(pool, "127.0.0.1", 0)
    try:
        port = server.address[1]
        assert push("127.0.0.1", port, KEY, b"a" * 1000)
        assert not push("127.0.0.1", port, "cd" * 20, b"b" * 1501)  # over the share alone
        assert push("127.0.0.1", port, "ef" * 20, b"c" * 1000)  # the older one makes room
        assert pool.held_bytes("127.0.0.1") == 1000 and pool.evicted == 1
        assert pool.claim(KEY) is None and pool.claim("ef" * 20) == b"c" * 1000
        assert pool.held_bytes("127.0.0.1") == 0
    finally:
        server.close()
    monkeypatch.setattr(p2p_push, "UNCLAIMED_TTL_S", 0.0)
    assert pool.put("10.0.0.9", KEY, b"d" * 10)
    assert pool.claim(KEY) is None  # nobody claimed it in time: dropped


def test_a_sender_not_listed_is_not_read():
    pool = PushPool(3000, frozenset({"10.0.0.9"}))
    server = PushServer(pool, "127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            push("127.0.0.1", server.address[1], KEY, b"a" * 100)
        assert len(pool) == 0 and pool.refused == 1
    finally:
        server.close()


class _WatchedPool(PushPool):
    """Notes, at each change of ``refused``, whether the pool's lock was held."""

    held: list[bool]

    @property
    def refused(self) -> int:
        return self._refused

    @refused.setter
    def refused(self, value: int) -> None:
        lock = self.__dict__.get("_lock")
        if lock is not None:
            self.__dict__.setdefault("held", []).append(lock.locked())
        self._refused = value


def test_refused_pushes_are_counted_under_the_pools_lock():
    """The listeners of every rank count refusals on their own threads: each count is taken
    under the pool's lock (a sender not listed; a listed one over its share)."""
    unlisted = _WatchedPool(3000, frozenset({"10.0.0.9"}))
    listed = _WatchedPool(3000, frozenset({"127.0.0.1"}))
    servers = [PushServer(unlisted, "127.0.0.1", 0), PushServer(listed, "127.0.0.1", 0)]
    try:
        with pytest.raises(OSError):
            push("127.0.0.1", servers[0].address[1], KEY, b"a" * 100)
        assert not push("127.0.0.1", servers[1].address[1], KEY, b"a" * 3001)
    finally:
        for server in servers:
            server.close()
    assert unlisted.refused == listed.refused == 1
    assert unlisted.held == listed.held == [True]


def test_put_async_sends_from_its_thread_and_drops_past_its_queue():
    pool = PushPool(100_000, frozenset({"127.0.0.1"}))
    server = PushServer(pool, "127.0.0.1", 0)
    try:
        pusher = Pusher(asynchronous=True, queue_bytes=1000)
        address = f"127.0.0.1:{server.address[1]}"
        pusher.send(address, KEY, b"a" * 600)
        pusher.send(address, "cd" * 20, b"b" * 600)  # NOTE: dropped if the first is queued
        pusher.flush()
        assert pusher.sent + pusher.failed == 2 and pusher.sent >= 1
        assert pool.claim(KEY) == b"a" * 600
    finally:
        server.close()


def _extra(role: str, **extra) -> dict:
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_role": role,
        "kv_port": 21001,
        "kv_connector_extra_config": extra,
    }


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_extra("kv_producer"), "decode_kv_addrs is required on a kv_producer with send_type"),
        (_extra("kv_producer", send_type="PUT"), "decode_kv_addrs is required"),
        (
            _extra("kv_producer", send_type="GET", decode_kv_addrs=["10.0.0.1:1"]),
            "decode_kv_addrs: only a kv_producer with send_type 'PUT' or 'PUT_ASYNC'",
        ),
        (
            _extra("kv_consumer", prefill_kv_addrs=["10.0.0.1:1"], decode_kv_addrs=["1.2.3.4:5"]),
            "decode_kv_addrs: only a kv_producer",
        ),
        (
            _extra("kv_producer", decode_kv_addrs=["host:1"]),
            "decode_kv_addrs: each entry must be 'ip:port'",
        ),
        (
            _extra("kv_producer", decode_kv_addrs=["10.0.0.1:1"], mem_pool_size_gb=4),
            "mem_pool_size_gb: the pool of received KV is a kv_consumer's",
        ),
        (
            _extra("kv_consumer", prefill_kv_addrs=["10.0.0.1:1"], mem_pool_size_gb="x"),
            "mem_pool_size_gb must be a number of GiB",
        ),
        (_extra("kv_both", decode_kv_addrs=["10.0.0.1:1"]), "'kv_both'"),
        (
            _extra("kv_consumer", prefill_kv_addrs=["10.0.0.1:1"], nccl_num_channels="8"),
            "NCCL",
        ),
    ],
)
def test_what_the_push_modes_cannot_take_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_config(config)


def test_vllms_push_configs_are_taken():
    producer = parse_kv_transfer_config(_extra("kv_producer", decode_kv_addrs=["10.0.0.1:22001"]))
    assert producer is not None and producer.p2p is not None
    assert producer.p2p.send_type == "PUT_ASYNC" and producer.p2p.pushes  # vLLM's default
    consumer = parse_kv_transfer_config(
        _extra("kv_consumer", prefill_kv_addrs=["10.0.0.1:1"], mem_pool_size_gb="0.5")
    )
    assert consumer is not None and consumer.p2p is not None
    assert consumer.p2p.receive_bytes == int(1e9) + 2**29
