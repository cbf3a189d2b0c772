"""vLLM's P2pNcclConnector over TCP ("GET": the decode instance pulls the prompt's KV from the
prefill instance named in the request id, off its steps). The decode instance's greedy tokens and logprobs
equal one plain instance's and it computes none of a transferred prompt's whole blocks; a lost
transfer (no prefill instance, a dropped connection, a silent peer past the deadline, evicted
KV) is recomputed within a bounded wait; the prefill's store is bounded by kv_buffer_size; a
request id naming a prefill address the consumer does not list is computed, never connected."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import trio
from kv_connectors import aligned, kv_engine, max_logprob_diff
from server_harness import free_port

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.kv_transfer import p2p_wire
from trillm.kv_transfer.config import parse_kv_transfer_config
from trillm.kv_transfer.engine_fit import resolve_kv_transfer
from trillm.kv_transfer.p2p import PrefillAddresses, prefill_address
from trillm.kv_transfer.p2p_wire import KVServer, SendStore, fetch

LENGTHS = (40, 17, 70, 9)  # 2, 1, 4 and 0 whole blocks before the last prompt token
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
KEY = "ab" * 20


def _kv(role: str, port: int, **extra) -> dict:
    """A producer's config serving on ``port``; a consumer's listing the prefill on ``port``."""
    if role == "kv_consumer":
        extra.setdefault("prefill_kv_addrs", [f"127.0.0.1:{port}"])
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_role": role,
        "kv_port": str(port),  # vLLM's examples give strings
        "kv_buffer_size": extra.pop("kv_buffer_size", "1e9"),
        "kv_connector_extra_config": {"send_type": "GET", **extra},
    }


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": list(range(5 + i, 5 + i + n))} for i, n in enumerate(LENGTHS)]


def _run(engine: LLM, port: int, params: SamplingParams = PARAMS) -> list:
    """The prompts under vLLM's proxy's request ids naming the prefill instance's port."""

    async def generate() -> list:
        n = len(LENGTHS)
        ids = [f"___prefill_addr_127.0.0.1:{port}___decode_addr_127.0.0.1:1_{i}" for i in range(n)]
        outs: list = [None] * n
        async with engine.engine.generate_many(_prompts(), [params] * n, ids) as items:
            async for index, out in items:
                outs[index] = out
        return outs

    try:
        return engine._call(generate)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def prefilled(tiny_model_factory):
    """(model path, the prefill instance's KV port, the plain engine's outputs)."""
    path = tiny_model_factory("qwen2")
    port = free_port()
    plain = _run(kv_engine(path), port)
    # NOTE: in-process ("uni"): its KV server thread outlives the engine, as a live instance
    _run(
        kv_engine(path, kv_transfer_config=_kv("kv_producer", port)),
        port,
        SamplingParams(max_tokens=1),
    )
    return path, port, plain


@pytest.mark.parametrize("chunk", [None, 7])
def test_the_decode_instance_pulls_the_prompts_and_matches(prefilled, chunk):
    path, port, plain = prefilled
    extra = {} if chunk is None else {"long_prefill_token_threshold": chunk}
    outs = _run(kv_engine(path, kv_transfer_config=_kv("kv_consumer", port), **extra), port)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain]
    # every whole block before the last prompt token came over the wire, none was computed
    assert [o.num_cached_tokens for o in outs] == [aligned(n) for n in LENGTHS]
    assert max_logprob_diff(outs, plain) < 1e-4


def test_no_prefill_instance_is_recomputed(prefilled, caplog):
    path, _, plain = prefilled
    gone = free_port()  # listed, but nothing listens there
    outs = _run(kv_engine(path, kv_transfer_config=_kv("kv_consumer", gone)), gone)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain]
    assert [o.num_cached_tokens for o in outs] == [0] * len(LENGTHS)
    assert max_logprob_diff(outs, plain) < 1e-4
    assert caplog.text.count("KV transfer failed") == 1  # the three: one line per 10 s


def test_an_unlisted_prefill_address_is_never_connected(prefilled, monkeypatch, caplog):
    """Request ids naming an address the consumer does not list (a client can set the request
    id): computed here as by the plain engine, and the named port never sees a connection."""
    path, port, plain = prefilled
    monkeypatch.setattr(p2p_wire, "FIRST_BYTE_TIMEOUT_S", 0.5)  # NOTE: bounds a failing run
    with socket.create_server(("127.0.0.1", 0)) as trap:
        trap.setblocking(False)
        outs = _run(
            kv_engine(path, kv_transfer_config=_kv("kv_consumer", port)), trap.getsockname()[1]
        )
        with pytest.raises(BlockingIOError):  # no connection is waiting to be accepted
            trap.accept()
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain]
    assert [o.num_cached_tokens for o in outs] == [0] * len(LENGTHS)
    assert max_logprob_diff(outs, plain) < 1e-4
    assert "not in kv_connector_extra_config.prefill_kv_addrs" in caplog.text
    assert "KV transfer failed" not in caplog.text


def test_the_door_lets_listed_addresses_only():
    door = PrefillAddresses(("10.0.1.2:21001", "::1:21002"))
    rid = "___prefill_addr_{}___decode_addr_10.0.1.3:22001_abc"
    assert door.lookup(rid.format("10.0.1.2:21001"), KEY) == f"10.0.1.2:21001/{KEY}"
    assert door.lookup(rid.format("0:0:0:0:0:0:0:1:21002"), KEY) == f"::1:21002/{KEY}"
    assert door.lookup("cmpl-plain-0", KEY) is None and door.refused == 0
    for named in ("10.0.1.2:21002", "169.254.169.254:80", "localhost:21001", "10.0.1.2:99999"):
        assert door.lookup(rid.format(named), KEY) is None
    assert door.refused == 4


def test_a_silent_listed_prefill_instance_does_not_stall_other_requests(prefilled):
    """A listed prefill instance that accepts and never answers: the transfer runs off the
    steps, so a running request's tokens keep coming at the step's pace (the longest gap
    between them well under the transfer's 1 s first-byte deadline, which it was when the
    fetch ran inside the step), the silent instance is asked once for three requests, and
    those requests are computed here as by the plain engine."""
    path, _, plain = prefilled
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody answers
        silent.setblocking(False)
        port = silent.getsockname()[1]
        engine = kv_engine(path, kv_transfer_config=_kv("kv_consumer", port))
        try:
            gaps, firsts = engine._call(lambda: _stream_beside_silent_loads(engine, port))
        finally:
            engine.shutdown()
        assert _connections(silent) == 1
    assert firsts == [out.outputs[0].token_ids[0] for out in plain[:3]]
    print(f"longest gap {max(gaps):.3f} s over {len(gaps)} gaps")
    assert max(gaps) < p2p_wire.FIRST_BYTE_TIMEOUT_S / 2, max(gaps)


async def _stream_beside_silent_loads(engine: LLM, port: int) -> tuple[list[float], list[int]]:
    """(the gaps between a running request's outputs while the first of three requests naming
    the silent instance at ``port`` waits for its transfer (the two after it find the instance
    paused), those three's first tokens). Three prompts of their own: a shared prefix would be
    a local hit, never fetched."""
    firsts: list[int] = []
    first_done = trio.Event()

    async def silent_requests() -> None:
        for i in range(3):
            rid = f"___prefill_addr_127.0.0.1:{port}___decode_addr_127.0.0.1:1_{i}"
            params = SamplingParams(temperature=0.0, max_tokens=1)
            async with engine.engine.generate(_prompts()[i], params, rid) as outs:
                async for out in outs:
                    firsts.extend(out.outputs[0].token_ids)
            first_done.set()

    gaps: list[float] = []
    params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(silent_requests)
        # NOTE: running requests one after another until the silent transfer ended (a fast
        # host decodes one's 240 tokens within its deadline); the gaps within each
        while not first_done.is_set():
            async with engine.engine.generate({"prompt_token_ids": [1, 2, 3]}, params) as outs:
                last = None
                async for _ in outs:
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if first_done.is_set():
                        break  # NOTE: it ran across the silent instance's deadline
    return gaps, firsts


def _connections(server: socket.socket) -> int:
    count = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            server.accept()[0].close()
            count += 1
    return count


@contextlib.contextmanager
def _silent_peer(answer: bytes, drop: bool = False) -> Iterator[int]:
    """A peer on the yielded port that reads the request, sends ``answer`` and holds the
    connection open until the test ends (``drop``: closes it)."""
    held: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as server:

        def serve() -> None:
            conn, _ = server.accept()
            held.append(conn)
            conn.recv(64)
            conn.sendall(answer)
            if drop:
                conn.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield server.getsockname()[1]
        finally:
            thread.join()
            for conn in held:
                conn.close()


@pytest.mark.parametrize(
    "answer", [b"", (100).to_bytes(8, "little") + b"x" * 10], ids=["nothing", "half"]
)
def test_a_silent_peer_ends_at_the_deadline(monkeypatch, answer):
    """No answer, or half of one: the fetch ends at its deadline (the decode instance
    recomputes), never waits on."""
    monkeypatch.setattr(p2p_wire, "FIRST_BYTE_TIMEOUT_S", 0.5)
    with _silent_peer(answer) as port, pytest.raises(TimeoutError):
        fetch("127.0.0.1", port, KEY, 1000)


def test_a_dropped_connection_fails(monkeypatch):
    """A prefill instance killed mid-answer: the fetch fails at once (the decode instance
    recomputes), well before its deadline."""
    monkeypatch.setattr(p2p_wire, "FIRST_BYTE_TIMEOUT_S", 300.0)
    with _silent_peer((100).to_bytes(8, "little") + b"x" * 10, drop=True) as port:
        with pytest.raises(ConnectionError, match="after 10 of 100 bytes"):
            fetch("127.0.0.1", port, KEY, 1000)


def test_the_server_answers_held_keys_within_the_asked_size():
    store = SendStore(10_000)
    store.put(KEY, b"y" * 500)
    server = KVServer(store, "127.0.0.1", 0)
    try:
        host, port = server.address
        assert host == "127.0.0.1"  # bound to kv_ip only
        assert fetch(host, port, KEY, 500) == b"y" * 500
        assert fetch(host, port, "cd" * 20, 500) is None
        with pytest.raises(ValueError, match="over the 499 asked"):
            fetch(host, port, KEY, 499)
    finally:
        server.close()


def test_the_store_is_bounded_by_kv_buffer_size():
    store = SendStore(1000)
    for i in range(50):  # a client sending many prompts the decode instance never takes
        assert store.put(f"{i:040x}", bytes(300))
        assert store.bytes <= 1000
    assert len(store) == 3 and store.evicted == 47
    assert store.get(f"{49:040x}") is not None and store.get(f"{0:040x}") is None
    assert not store.put("ff" * 20, bytes(1001))  # over the whole buffer: not kept
    assert store.bytes <= 1000


def test_evicted_kv_is_recomputed(prefilled, tiny_model_factory):
    """A prefill store of kv_buffer_size bytes holds the last prompt only: the others'
    decode requests find nothing and compute their prompts."""
    path, _, plain = prefilled
    port = free_port()
    producer = kv_engine(path, kv_transfer_config=_kv("kv_producer", port, kv_buffer_size=30_000))
    _run(producer, port, SamplingParams(max_tokens=1))
    outs = _run(kv_engine(path, kv_transfer_config=_kv("kv_consumer", port)), port)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain]
    cached = [o.num_cached_tokens for o in outs]
    assert 0 < sum(cached) < sum(aligned(n) for n in LENGTHS)


def test_the_request_id_names_the_prefill_instance():
    rid = "___prefill_addr_10.0.1.2:21001___decode_addr_10.0.1.3:22001_abc"
    assert prefill_address(f"cmpl-{rid}-0") == ("10.0.1.2", 21001)
    assert prefill_address("cmpl-plain-0") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_connector_extra_config": {"send_type": "GET", "nccl_num_channels": "8"}}, "NCCL"),
        ({"kv_connector_extra_config": {"send_type": "GET", "proxy_ip": "1.2.3.4"}}, "proxy_ip"),
        ({"kv_connector_extra_config": {"send_type": "GET", "x": 1}}, "does not take x"),
        ({"kv_role": "kv_both"}, "'kv_both'"),
        ({"kv_buffer_device": "cuda"}, "kv_buffer_device 'cuda'"),
        ({"kv_port": 70000}, "kv_port must be a port"),
        ({"kv_port": "abc"}, "kv_port must be a number"),
        ({"kv_buffer_size": 0}, "kv_buffer_size must be >= 1"),
        ({"kv_ip": "example.com"}, "kv_ip must be an IP address"),
        ({"kv_connector_extra_config": {"send_type": "GET"}}, "prefill_kv_addrs is required"),
        (
            {"kv_connector_extra_config": {"send_type": "GET", "prefill_kv_addrs": ["h:1"]}},
            "each entry must be 'ip:port'",
        ),
        (
            {"kv_connector_extra_config": {"send_type": "GET", "prefill_kv_addrs": []}},
            "non-empty list",
        ),
        ({"kv_role": "kv_producer"}, "prefill_kv_addrs: a kv_producer fetches no KV"),
    ],
)
def test_what_the_p2p_connector_cannot_take_is_refused_by_name(change, message):
    config = {**_kv("kv_consumer", 21001), **change}
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_config(config)


def test_vllms_p2p_example_is_taken():
    config = parse_kv_transfer_config(
        {**_kv("kv_producer", 21001, kv_buffer_size="1e1"), "kv_ip": "10.0.1.2"}
    )
    assert config is not None and config.p2p is not None
    assert (config.p2p.kv_ip, config.p2p.kv_port, config.p2p.kv_buffer_size) == (
        "10.0.1.2",
        21001,
        10,
    )


def test_refusals_and_the_log_name_the_p2p_connector(caplog):
    kv = _kv("kv_consumer", 21001)
    fit = (SimpleNamespace(mm_config=None), None, None, False, False)
    with pytest.raises(ValueError, match=r"\(P2pNcclConnector\) with nnodes > 1"):
        resolve_kv_transfer(
            EngineArgs(model="m", tensor_parallel_size=2, nnodes=2, kv_transfer_config=kv), *fit
        )
    with caplog.at_level(logging.INFO, logger="trillm.kv_transfer.engine_fit"):
        resolve_kv_transfer(EngineArgs(model="m", kv_transfer_config=kv), *fit)
    assert "P2pNcclConnector (kv_consumer), fetching from 127.0.0.1:21001" in caplog.text


def test_a_consumer_lists_its_prefill_instances_in_normal_form():
    addrs = ["[0:0::1]:21001", "10.0.1.2:21001", "10.0.1.2:21001"]
    config = parse_kv_transfer_config(_kv("kv_consumer", 1, prefill_kv_addrs=addrs))
    assert config is not None and config.p2p is not None
    assert config.p2p.prefill_kv_addrs == ("10.0.1.2:21001", "::1:21001")
