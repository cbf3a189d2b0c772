"""Prefill/decode disaggregation over HTTP with the official ``openai`` client: a prefill
instance (kv_producer) and a decode instance (kv_consumer) of the SharedStorageConnector
behind ``trillm.entrypoints.disagg_proxy``. The proxy's answers equal one instance's; the
decode instance computes none of the prompt tokens the prefill instance stored (its
``vllm:external_prefix_cache_hits``), and a truncated file is recomputed, not read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_harness import REPO, ServerProcess, free_port, metric_value, run_trillm, server_env

BLOCK = 16
ARGS = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--block-size", str(BLOCK)]
ARGS += ["--served-model-name", "tiny"]
PROMPTS = [list(range(7 + i, 7 + i + n)) for i, n in enumerate((70, 33, 20))]


def _kv(role: str, folder: str) -> str:
    return json.dumps(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": folder},
        }
    )


def _aligned(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    """(prefill server, decode server, proxy URL, storage folder)."""
    path = tiny_model_factory("qwen2")
    logs = tmp_path_factory.mktemp("disagg")
    folder = str(logs / "kv")
    prefill = ServerProcess(
        [path, *ARGS, "--kv-transfer-config", _kv("kv_producer", folder)], logs / "p.log"
    )
    decode = ServerProcess(
        [path, *ARGS, "--kv-transfer-config", _kv("kv_consumer", folder)], logs / "d.log"
    )
    prefill.start()
    decode.start()
    port = free_port()
    command = [sys.executable, "-m", "trillm.entrypoints.disagg_proxy", "--prefill", prefill.url]
    command += ["--decode", decode.url, "--port", str(port)]
    with open(logs / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(command, cwd=REPO, env=server_env(), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proxy)
    yield prefill, decode, url, folder
    proxy.terminate()
    proxy.wait(timeout=30)
    assert prefill.stop() == 0, prefill.log()
    assert decode.stop() == 0, decode.log()


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the proxy exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the proxy is not healthy")


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(base: str, prompt: list[int]) -> tuple[str, list[float]]:
    out = _client(base).completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1
    )
    choice = out.choices[0]
    return choice.text, choice.logprobs.token_logprobs


def _metric(server: ServerProcess, name: str) -> float:
    return metric_value(httpx.get(server.url + "/metrics").text, name)


def test_the_pair_answers_as_one_instance_and_decode_computes_no_stored_token(pair):
    prefill, decode, proxy, folder = pair
    for prompt in PROMPTS:
        text, logprobs = _complete(proxy, prompt)
        alone_text, alone = _complete(prefill.url, prompt)  # the prefill instance alone
        assert text == alone_text
        assert max(abs(a - b) for a, b in zip(logprobs, alone, strict=True)) < 1e-4
    stored = sum(_aligned(len(p)) for p in PROMPTS)
    assert _metric(decode, "vllm:external_prefix_cache_hits_total") == stored
    computed = _metric(decode, "vllm:prompt_tokens_total") - stored
    assert computed == sum(len(p) - _aligned(len(p)) for p in PROMPTS)  # only the unaligned tail
    assert len(os.listdir(folder)) == len(PROMPTS)


def test_a_streamed_chat_through_the_pair_equals_one_instance(pair):
    prefill, _, proxy, _ = pair
    messages = [{"role": "user", "content": "The license grants every holder " * 6}]
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0}
    stream = _client(proxy).chat.completions.create(stream=True, **kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    alone = _client(prefill.url).chat.completions.create(**kwargs)
    assert text == alone.choices[0].message.content


def test_a_truncated_file_is_recomputed_by_the_decode_instance(pair):
    prefill, decode, _, folder = pair
    prompt = list(range(300, 350))
    before = set(os.listdir(folder))
    alone_text, alone = _complete(prefill.url, prompt)  # stored; the decode instance never saw it
    (name,) = set(os.listdir(folder)) - before
    with open(os.path.join(folder, name), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    hits = _metric(decode, "vllm:external_prefix_cache_hits_total")
    text, logprobs = _complete(decode.url, prompt)
    assert text == alone_text
    assert max(abs(a - b) for a, b in zip(logprobs, alone, strict=True)) < 1e-4
    assert _metric(decode, "vllm:external_prefix_cache_hits_total") == hits  # nothing loaded
    assert "is truncated or not this model's: recomputing" in decode.log()


def test_kv_transfer_params_are_refused_by_name(pair):
    _, decode, _, _ = pair
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params"):
        _client(decode.url).completions.create(
            model="tiny",
            prompt="x",
            max_tokens=1,
            extra_body={"kv_transfer_params": {"do_remote_decode": True}},
        )


def test_other_connectors_stop_serve_naming_them(tiny_model_factory, tmp_path):
    config = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    out = run_trillm(
        ["serve", tiny_model_factory("qwen2"), *ARGS, "--kv-transfer-config", config],
        tmp_path / "log",
    )
    assert out.returncode != 0
    assert "'LMCacheConnectorV1' is not implemented" in out.output
