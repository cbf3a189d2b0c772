"""vLLM's P2pNcclConnector under tensor and pipeline parallelism: rank r of the prefill
instance keeps (GET) or pushes (PUT, PUT_ASYNC) its own share of a prompt's KV on port + r of
the address the request id names; the decode instance takes a prompt only when every rank's
share came, and its rank r loads share r. Greedy tokens equal the one-rank engine without a
connector, vLLM's external_prefix_cache_hits and prompt_tokens_by_source count the moved
tokens; one rank's share lost computes the whole prompt on every rank; a prefill instance of
another split is named as such in the warning and its prompts computed, never loaded."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import pytest
from kv_connectors import (
    aligned,
    consecutive_free_ports,
    generate_with_ids,
    kv_engine,
    max_logprob_diff,
    p2p_ids,
    p2p_kv,
)

from trillm import LLM, SamplingParams
from trillm.kv_transfer import p2p_recv, p2p_wire

LENGTHS = (40, 70, 9)  # 2, 4 and 0 whole blocks before the last prompt token
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
MOVED = sum(aligned(n) for n in LENGTHS)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(first: int) -> list[dict]:
    return [
        {"prompt_token_ids": list(range(first + i, first + i + n))} for i, n in enumerate(LENGTHS)
    ]


def _ids(prefill: int, decode: int, tag: str) -> list[str]:
    return p2p_ids(prefill, decode, tag, len(LENGTHS))


def _generate(
    engine: LLM, prompts: list[dict], ids: list[str], params: SamplingParams = PARAMS
) -> list:
    return generate_with_ids(engine, prompts, ids, params)


def _tokens(outs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@contextlib.contextmanager
def _engines(*engines: LLM) -> Iterator[None]:
    try:
        yield
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.fixture(scope="module")
def plain(tiny_model_factory):
    """(model path, {first token: the one-rank engine's outputs of those prompts})."""
    path = tiny_model_factory("qwen2")
    engine = kv_engine(path)
    with _engines(engine):
        outs = {
            first: _generate(engine, _prompts(first), _ids(1, 1, f"plain{first}-"))
            for first in (5, 300, 600)
        }
    return path, outs


@pytest.fixture(scope="module")
def tp2_prefill(plain):
    """A TP=2 prefill instance ("GET") that computed both prompt sets -> its base port."""
    path, _ = plain
    port = consecutive_free_ports(2)
    producer = kv_engine(path, 2, 1, kv_transfer_config=p2p_kv("kv_producer", "GET", port, 1))
    with _engines(producer):
        for first in (5, 300, 600):
            _generate(
                producer, _prompts(first), _ids(port, 1, f"p{first}-"), SamplingParams(max_tokens=1)
            )
        yield port


def _check_loaded(outs: list, reference: list, stats) -> None:
    assert _tokens(outs) == _tokens(reference)
    assert max_logprob_diff(outs, reference) < 1e-3
    # every whole block before the last prompt token came over the wire, none was computed
    assert [o.num_cached_tokens for o in outs] == [aligned(n) for n in LENGTHS]
    assert stats.external_prefix_cache_hits == MOVED
    assert stats.prompt_tokens_by_source["external_kv_transfer"] == MOVED


def test_tp2_decode_fetches_each_ranks_share_and_a_lost_or_damaged_one_is_recomputed(
    plain, tp2_prefill, monkeypatch, caplog
):
    path, reference = plain
    consumer = kv_engine(
        path, 2, 1, kv_transfer_config=p2p_kv("kv_consumer", "GET", tp2_prefill, 1)
    )
    with _engines(consumer):
        outs = _generate(consumer, _prompts(5), _ids(tp2_prefill, 1, "a"))
        _check_loaded(outs, reference[5], consumer.engine.get_stats())
        # rank 1's share of the other prompts is lost on the way: computed on every rank
        fetch, asked = p2p_wire.fetch, []

        def lose_rank_1(host: str, port: int, key: str, max_bytes: int, *fetches) -> bytes | None:
            asked.append(port - tp2_prefill)
            if port == tp2_prefill + 1:
                raise ConnectionError("dropped")
            return fetch(host, port, key, max_bytes, *fetches)

        monkeypatch.setattr(p2p_wire, "fetch", lose_rank_1)
        lost = _generate(consumer, _prompts(300), _ids(tp2_prefill, 1, "b"))
        stats = consumer.engine.get_stats()

        # rank 1's share of the last prompts comes damaged: rank 1's worker finds it so
        # (the digest) after the engine core took it, and every rank computes those prompts
        def damage_rank_1(host: str, port: int, key: str, max_bytes: int, *fetches) -> bytes | None:
            blob = fetch(host, port, key, max_bytes, *fetches)
            if port == tp2_prefill + 1 and blob is not None:
                blob = blob[:-1] + bytes([blob[-1] ^ 1])
            return blob

        monkeypatch.setattr(p2p_wire, "fetch", damage_rank_1)
        damaged = _generate(consumer, _prompts(600), _ids(tp2_prefill, 1, "e"))
        after = consumer.engine.get_stats()
    assert sorted(asked) == [0, 0, 1, 1]  # both ranks asked for the two prompts with blocks
    assert _tokens(lost) == _tokens(reference[300])
    assert max_logprob_diff(lost, reference[300]) < 1e-3
    assert [o.num_cached_tokens for o in lost] == [0] * len(LENGTHS)
    assert stats.external_prefix_cache_hits == MOVED  # the first set's alone
    assert "KV transfer failed: dropped" in caplog.text
    assert _tokens(damaged) == _tokens(reference[600])
    assert max_logprob_diff(damaged, reference[600]) < 1e-3
    assert [o.num_cached_tokens for o in damaged] == [0] * len(LENGTHS)
    assert after.external_prefix_cache_hits == MOVED  # loaded, then taken back
    assert after.prompt_tokens_by_source["external_kv_transfer"] == MOVED
    assert "KV load failed (KV connector load: " in caplog.text


def test_a_prefill_instance_of_another_split_is_named_and_recomputed(plain, tp2_prefill, caplog):
    path, reference = plain
    consumer = kv_engine(path, kv_transfer_config=p2p_kv("kv_consumer", "GET", tp2_prefill, 1))
    with _engines(consumer), caplog.at_level(logging.DEBUG, logger="trillm.kv_transfer"):
        outs = _generate(consumer, _prompts(5), _ids(tp2_prefill, 1, "c"))
        stats = consumer.engine.get_stats()
    assert _tokens(outs) == _tokens(reference[5])
    assert [o.num_cached_tokens for o in outs] == [0] * len(LENGTHS)
    assert stats.external_prefix_cache_hits == 0
    assert (
        "the prefill instance's KV is split tensor_parallel_size=2, pipeline_parallel_size=1, "
        "this instance's tensor_parallel_size=1, pipeline_parallel_size=1: P2pNcclConnector "
        "pairs the two instances' ranks by number" in caplog.text
    )


@pytest.mark.parametrize(
    ("tp", "pp", "send_type"), [(2, 1, "PUT"), (1, 2, "GET"), (1, 2, "PUT_ASYNC")]
)
def test_each_rank_sends_its_share_and_the_decode_matches(plain, tp, pp, send_type):
    path, reference = plain
    prefill, decode = consecutive_free_ports(2), consecutive_free_ports(2)
    consumer = kv_engine(
        path, tp, pp, kv_transfer_config=p2p_kv("kv_consumer", send_type, prefill, decode)
    )
    producer = kv_engine(
        path, tp, pp, kv_transfer_config=p2p_kv("kv_producer", send_type, prefill, decode)
    )
    ids = _ids(prefill, decode, "d")
    with _engines(consumer, producer):
        _generate(producer, _prompts(5), ids, SamplingParams(max_tokens=1))
        outs = _generate(consumer, _prompts(5), ids)
        _check_loaded(outs, reference[5], consumer.engine.get_stats())
    if send_type != "GET":  # the decode instance's listeners, one per rank, are closed
        for rank in range(2):
            p2p_wire.listen("127.0.0.1", decode + rank).close()


def test_a_push_of_another_split_fails_at_once_and_is_named(plain, monkeypatch, caplog):
    """A one-rank prefill instance pushes to a TP=2 decode instance: rank 0's share came
    (rank 1's never will), its header names the other split, so the request is computed at
    once, not after the wait for the missing share."""
    monkeypatch.setattr(p2p_recv, "PUSH_WAIT_S", 30.0)  # NOTE: a run waiting for it fails
    path, reference = plain
    prefill, decode = consecutive_free_ports(1), consecutive_free_ports(2)
    consumer = kv_engine(
        path, 2, 1, kv_transfer_config=p2p_kv("kv_consumer", "PUT", prefill, decode)
    )
    producer = kv_engine(path, kv_transfer_config=p2p_kv("kv_producer", "PUT", prefill, decode))
    ids = _ids(prefill, decode, "f")
    with _engines(consumer, producer):
        _generate(producer, _prompts(5), ids, SamplingParams(max_tokens=1))
        start = time.monotonic()
        outs = _generate(consumer, _prompts(5), ids)
        took = time.monotonic() - start
        stats = consumer.engine.get_stats()
    assert took < 20
    assert _tokens(outs) == _tokens(reference[5])
    assert [o.num_cached_tokens for o in outs] == [0] * len(LENGTHS)
    assert stats.external_prefix_cache_hits == 0
    assert (
        "the prefill instance's KV is split tensor_parallel_size=1, pipeline_parallel_size=1, "
        "this instance's tensor_parallel_size=2, pipeline_parallel_size=1" in caplog.text
    )
