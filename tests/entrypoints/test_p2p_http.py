"""vLLM's P2pNcclConnector ("GET", over TCP) over HTTP: a prefill instance (kv_producer, its KV
server on kv_port) and a decode instance (kv_consumer) behind ``trillm.entrypoints.disagg_proxy
--prefill-kv-addr``, which names the prefill's KV address in each request id as vLLM's proxy
does. The proxy's answers equal one instance's, the decode instance computes none of the
transferred prompt tokens (``vllm:external_prefix_cache_hits``), and a request naming a prefill
instance that is gone is recomputed."""

from __future__ import annotations

import json

import pytest
from kv_connectors import (
    assert_pair_answers_as_one_instance,
    assert_recomputed,
    complete,
    disagg_pair,
)
from server_harness import free_port


def _kv(role: str, port: int, allowed: tuple[int, ...] = ()) -> str:
    """``allowed``: the prefill KV ports a consumer lists (``prefill_kv_addrs``)."""
    extra: dict = {"send_type": "GET"}
    if allowed:
        extra["prefill_kv_addrs"] = [f"127.0.0.1:{p}" for p in allowed]
    return json.dumps(
        {
            "kv_connector": "P2pNcclConnector",
            "kv_role": role,
            "kv_ip": "127.0.0.1",
            "kv_port": port,
            "kv_buffer_size": 1e8,
            "kv_connector_extra_config": extra,
        }
    )


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    """(prefill server, decode server, proxy URL, a listed KV port nothing listens on)."""
    model, logs = tiny_model_factory("qwen2"), tmp_path_factory.mktemp("p2p")
    kv_port, gone = free_port(), free_port()
    prefill_kv = _kv("kv_producer", kv_port)
    decode_kv = _kv("kv_consumer", free_port(), (kv_port, gone))
    proxy_args = ("--prefill-kv-addr", f"127.0.0.1:{kv_port}")
    with disagg_pair(model, logs, prefill_kv, decode_kv, proxy_args) as servers:
        yield *servers, gone


def test_the_pair_answers_as_one_instance_and_decode_computes_no_transferred_token(pair):
    assert_pair_answers_as_one_instance(*pair[:3])


def test_a_prefill_instance_that_is_gone_is_recomputed(pair):
    prefill, decode, _, gone_port = pair
    prompt = list(range(300, 350))
    gone = f"___prefill_addr_127.0.0.1:{gone_port}___decode_addr__x1"  # listed, none there
    assert_recomputed(decode, prompt, complete(prefill.url, prompt), request_id=gone)
    assert "KV transfer failed" in decode.log()
