"""vLLM's P2pNcclConnector ("GET", over TCP) over HTTP: a prefill instance (kv_producer, its KV
server on kv_port) and a decode instance (kv_consumer) behind ``trillm.entrypoints.disagg_proxy
--prefill-kv-addr``, which names the prefill's KV address in each request id as vLLM's proxy
does. The proxy's answers equal one instance's, the decode instance computes none of the
transferred prompt tokens (``vllm:external_prefix_cache_hits``), and a request naming a prefill
instance that is gone is recomputed."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from server_harness import REPO, ServerProcess, free_port, metric_value, server_env
from test_disagg_http import _wait_healthy

BLOCK = 16
ARGS = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--block-size", str(BLOCK)]
ARGS += ["--served-model-name", "tiny"]
PROMPTS = [list(range(7 + i, 7 + i + n)) for i, n in enumerate((70, 33, 20))]


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


def _aligned(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    """(prefill server, decode server, proxy URL, a listed KV port nothing listens on)."""
    path = tiny_model_factory("qwen2")
    logs = tmp_path_factory.mktemp("p2p")
    kv_port, gone = free_port(), free_port()
    prefill = ServerProcess(
        [path, *ARGS, "--kv-transfer-config", _kv("kv_producer", kv_port)], logs / "p.log"
    )
    decode = ServerProcess(
        [path, *ARGS, "--kv-transfer-config", _kv("kv_consumer", free_port(), (kv_port, gone))],
        logs / "d.log",
    )
    prefill.start()
    decode.start()
    port = free_port()
    command = [sys.executable, "-m", "trillm.entrypoints.disagg_proxy", "--prefill", prefill.url]
    command += ["--decode", decode.url, "--port", str(port)]
    command += ["--prefill-kv-addr", f"127.0.0.1:{kv_port}"]
    with open(logs / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(command, cwd=REPO, env=server_env(), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proxy)
    yield prefill, decode, url, gone
    proxy.terminate()
    proxy.wait(timeout=30)
    assert prefill.stop() == 0, prefill.log()
    assert decode.stop() == 0, decode.log()


def _complete(base: str, prompt: list[int], **extra) -> tuple[str, list[float]]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1, extra_body=extra
    )
    choice = out.choices[0]
    return choice.text, choice.logprobs.token_logprobs


def _metric(server: ServerProcess, name: str) -> float:
    return metric_value(httpx.get(server.url + "/metrics").text, name)


def test_the_pair_answers_as_one_instance_and_decode_computes_no_transferred_token(pair):
    prefill, decode, proxy, _ = pair
    for prompt in PROMPTS:
        text, logprobs = _complete(proxy, prompt)
        alone_text, alone = _complete(prefill.url, prompt)  # the prefill instance alone
        assert text == alone_text
        assert max(abs(a - b) for a, b in zip(logprobs, alone, strict=True)) < 1e-4
    moved = sum(_aligned(len(p)) for p in PROMPTS)
    assert _metric(decode, "vllm:external_prefix_cache_hits_total") == moved
    computed = _metric(decode, "vllm:prompt_tokens_total") - moved
    assert computed == sum(len(p) - _aligned(len(p)) for p in PROMPTS)  # only the unaligned tail


def test_a_prefill_instance_that_is_gone_is_recomputed(pair):
    prefill, decode, _, gone_port = pair
    prompt = list(range(300, 350))
    alone_text, alone = _complete(prefill.url, prompt)
    hits = _metric(decode, "vllm:external_prefix_cache_hits_total")
    gone = f"___prefill_addr_127.0.0.1:{gone_port}___decode_addr__x1"  # listed, none there
    text, logprobs = _complete(decode.url, prompt, request_id=gone)
    assert text == alone_text
    assert max(abs(a - b) for a, b in zip(logprobs, alone, strict=True)) < 1e-4
    assert _metric(decode, "vllm:external_prefix_cache_hits_total") == hits  # nothing loaded
    assert "KV transfer failed" in decode.log()
