"""Prefill/decode disaggregation with tensor parallelism: a prefill instance (kv_producer) and
a decode instance (kv_consumer) of the SharedStorageConnector, each on two tensor-parallel
ranks, behind ``trillm.entrypoints.disagg_proxy``. Each rank stores and loads its own share of
a prompt's KV; through the proxy the greedy tokens equal the one-rank engine's without a
connector, the decode instance's ``vllm:external_prefix_cache_hits`` and
``vllm:prompt_tokens_by_source`` count the moved tokens, and /metrics shows vLLM's
``vllm:kv_offload_*`` series on an instance with ``--kv-offloading-size``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
from kv_connectors import wait_healthy
from server_harness import REPO, ServerProcess, free_port, metric_value, server_env

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config

BLOCK = 16
ARGS = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--block-size", str(BLOCK)]
ARGS += ["--served-model-name", "tiny", "--tensor-parallel-size", "2"]
PROMPTS = [list(range(7 + i, 7 + i + n)) for i, n in enumerate((70, 33, 20))]
MAX_TOKENS = 6


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


def _tokens(base: str, prompt: list[int]) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _metric(server: ServerProcess, name: str) -> float:
    return metric_value(httpx.get(server.url + "/metrics").text, name)


def test_a_tp2_pair_through_the_proxy_equals_one_rank(tiny_model_factory, tmp_path):
    path = tiny_model_factory("qwen2")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with LLM(path, max_model_len=256, block_size=BLOCK, distributed_executor_backend="uni") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    reference = [list(o.outputs[0].token_ids) for o in outs]
    folder = str(tmp_path / "kv")
    prefill = ServerProcess(
        [path, *ARGS, "--kv-transfer-config", _kv("kv_producer", folder)], tmp_path / "p.log"
    )
    decode = ServerProcess(
        [path, *ARGS, "--kv-transfer-config", _kv("kv_consumer", folder)], tmp_path / "d.log"
    )
    prefill.start()
    decode.start()
    port = free_port()
    command = [sys.executable, "-m", "trillm.entrypoints.disagg_proxy", "--prefill", prefill.url]
    command += ["--decode", decode.url, "--port", str(port)]
    with open(tmp_path / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(command, cwd=REPO, env=server_env(), stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proxy)
        assert [_tokens(url, p) for p in PROMPTS] == reference
        stored = sum(_aligned(len(p)) for p in PROMPTS)
        assert _metric(decode, "vllm:external_prefix_cache_hits_total") == stored
        by_source = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source='
        page = httpx.get(decode.url + "/metrics").text
        assert f'{by_source}"external_kv_transfer"}} {float(stored)}' in page
        names = sorted(os.listdir(folder))
        assert len(names) == 2 * len(PROMPTS) and {n[-6:] for n in names} == {".r0.kv", ".r1.kv"}
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        assert prefill.stop() == 0, prefill.log()
        assert decode.stop() == 0, decode.log()


def test_the_offload_series_on_metrics(tiny_model_factory, tmp_path):
    """A two-rank instance with the tier: a prompt stored on its first pass, evicted from the
    small KV cache by two others, loaded back; the series count those blocks' bytes."""
    path = tiny_model_factory("qwen2")
    args = [path, "--max-model-len", "256", "--num-gpu-blocks-override", "20"]
    args += ["--block-size", str(BLOCK), "--served-model-name", "tiny"]
    args += ["--tensor-parallel-size", "2", "--kv-offloading-size", "0.01"]
    server = ServerProcess(args, tmp_path / "s.log").start()
    try:
        first = list(range(10, 110))
        for prompt in (first, list(range(200, 400)), list(range(400, 560)), first):
            _tokens(server.url, prompt)
        loaded = _metric(server, "vllm:external_prefix_cache_hits_total") // BLOCK
        assert loaded == 6  # the first prompt's 6 whole blocks came back from the tier
        tier = build_config(
            EngineArgs(
                model=path, block_size=BLOCK, kv_offloading_size=0.01, tensor_parallel_size=2
            )
        ).kv_offload
        assert tier is not None
        block = tier.block_bytes  # over both ranks
        assert _metric(server, "vllm:kv_offload_load_bytes_total") == loaded * block
        assert _metric(server, "vllm:kv_offload_load_size_sum") == loaded * block
        assert _metric(server, "vllm:kv_offload_load_size_count") == 2  # one per rank
        assert _metric(server, "vllm:kv_offload_load_time_total") > 0  # the ranks' seconds
        stored = _metric(server, "vllm:kv_offload_store_bytes_total")
        assert stored > 0 and stored % block == 0
        legacy = _metric(server, "vllm:kv_offload_total_bytes_total")
        assert legacy == stored + loaded * block
    finally:
        assert server.stop() == 0, server.log()
