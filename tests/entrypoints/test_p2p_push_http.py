"""vLLM's P2pNcclConnector push modes over HTTP ("PUT": the prefill instance pushes a prompt's
KV to the decode instance inside its step; "PUT_ASYNC", vLLM's default: from a background
thread): a prefill instance (kv_producer, pushing to the decode address its operator lists) and
a decode instance (kv_consumer, its push receiver on kv_port) behind
``trillm.entrypoints.disagg_proxy --prefill-kv-addr --decode-kv-addr``, which name both
addresses in each request id as vLLM's proxy does. The proxy's answers equal one instance's
and the decode instance computes none of the pushed prompt tokens
(``vllm:external_prefix_cache_hits``)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from kv_connectors import wait_healthy
from server_harness import REPO, ServerProcess, free_port, metric_value, server_env

BLOCK = 16
ARGS = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--block-size", str(BLOCK)]
ARGS += ["--served-model-name", "tiny"]
PROMPTS = [list(range(7 + i, 7 + i + n)) for i, n in enumerate((70, 33, 20))]


def _kv(role: str, send_type: str, port: int, peer: int) -> str:
    """``port``: this instance's kv_port; ``peer``: the other's, which it lists."""
    listed = "decode_kv_addrs" if role == "kv_producer" else "prefill_kv_addrs"
    extra: dict = {"send_type": send_type, listed: [f"127.0.0.1:{peer}"]}
    if role == "kv_consumer":
        extra["mem_pool_size_gb"] = 0.1
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


def _complete(base: str, prompt: list[int]) -> tuple[str, list[float]]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1
    )
    return out.choices[0].text, out.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("send_type", ["PUT", "PUT_ASYNC"])
def test_the_pushing_pair_answers_as_one_instance(tiny_model_factory, tmp_path, send_type):
    model = tiny_model_factory("qwen2")
    p_port, d_port = free_port(), free_port()
    prefill = ServerProcess(
        [model, *ARGS, "--kv-transfer-config", _kv("kv_producer", send_type, p_port, d_port)],
        tmp_path / "p.log",
    )
    decode = ServerProcess(
        [model, *ARGS, "--kv-transfer-config", _kv("kv_consumer", send_type, d_port, p_port)],
        tmp_path / "d.log",
    )
    prefill.start()
    decode.start()
    port = free_port()
    command = [sys.executable, "-m", "trillm.entrypoints.disagg_proxy", "--prefill", prefill.url]
    command += ["--decode", decode.url, "--port", str(port)]
    command += [
        "--prefill-kv-addr",
        f"127.0.0.1:{p_port}",
        "--decode-kv-addr",
        f"127.0.0.1:{d_port}",
    ]
    with open(tmp_path / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(command, cwd=REPO, env=server_env(), stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proxy)
        for prompt in PROMPTS:
            text, logprobs = _complete(url, prompt)
            alone_text, alone = _complete(prefill.url, prompt)  # the prefill instance alone
            assert text == alone_text
            assert max(abs(a - b) for a, b in zip(logprobs, alone, strict=True)) < 1e-4
        metrics = httpx.get(decode.url + "/metrics").text
        moved = sum(_aligned(len(p)) for p in PROMPTS)
        assert metric_value(metrics, "vllm:external_prefix_cache_hits_total") == moved
        computed = metric_value(metrics, "vllm:prompt_tokens_total") - moved
        assert computed == sum(len(p) - _aligned(len(p)) for p in PROMPTS)  # the tails only
        assert "KV transfer failed" not in decode.log()
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        assert prefill.stop() == 0, prefill.log()
        assert decode.stop() == 0, decode.log()
