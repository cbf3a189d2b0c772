"""What the KV connector tests share: in process, a small engine (``kv_engine``), a prompt's
block-aligned prefix short of its last token (``aligned``, what a connector moves), the
connectors' configs (P2P's with its ports, ``consecutive_free_ports``, and request ids), a
batch with given request ids (``generate_with_ids``), rounds of batches on one engine
(``run_rounds``), and the largest logprob difference of two runs; over HTTP, a prefill
(kv_producer) and a decode (kv_consumer) ``trillm serve`` behind
``trillm.entrypoints.disagg_proxy`` (``disagg_pair``), a completion with its logprobs, and a
server's metric."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
from server_harness import REPO, ServerProcess, free_port, metric_value, server_env

if TYPE_CHECKING:
    from trillm import LLM, SamplingParams
    from trillm.messages import SchedulerStats

BLOCK = 16
# the HTTP pairs' server flags
SERVE_ARGS = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--block-size", str(BLOCK)]
SERVE_ARGS += ["--served-model-name", "tiny"]
PAIR_PROMPTS = [list(range(7 + i, 7 + i + n)) for i, n in enumerate((70, 33, 20))]


def kv_engine(path: str, tp: int = 1, pp: int = 1, **kwargs) -> LLM:
    """An in-process engine (``trillm.LLM``) with a small KV cache: executor "uni" on one rank,
    "mp" over ``tp`` x ``pp`` ranks (tensor x pipeline parallel), unless ``kwargs`` names
    ``distributed_executor_backend``."""
    from trillm import LLM  # NOTE: here: the HTTP tests' process never imports the engine

    kwargs.setdefault("distributed_executor_backend", "uni" if tp * pp == 1 else "mp")
    return LLM(
        path,
        max_model_len=256,
        kv_cache_memory="8MiB",
        block_size=BLOCK,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **kwargs,
    )


def aligned(n: int) -> int:
    """The tokens a connector moves of an ``n``-token prompt: whole blocks before its last."""
    return (n - 1) // BLOCK * BLOCK


def shared_storage_kv(role: str, folder: str, **extra) -> dict:
    """vLLM's SharedStorageConnector on ``folder`` (``extra``: more extra-config keys)."""
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": folder, **extra},
    }


def consecutive_free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free (rank r's port: p + r), from this xdist worker's
    block below the ephemeral range (``free_port`` hands them out in order), so that no
    outgoing connection takes p + r before its listener binds it."""
    for _ in range(100):
        ports = [free_port() for _ in range(n)]
        if ports == list(range(ports[0], ports[0] + n)):
            return ports[0]
    raise RuntimeError(f"no {n} consecutive free ports")


def p2p_kv(role: str, send_type: str, prefill: int, decode: int) -> dict:
    """vLLM's P2pNcclConnector: a producer on ``prefill`` (pushing to ``decode`` unless
    "GET"), a consumer on ``decode`` reading from ``prefill``."""
    extra: dict = {"send_type": send_type}
    if role == "kv_consumer":
        extra["prefill_kv_addrs"] = [f"127.0.0.1:{prefill}"]
    elif send_type != "GET":
        extra["decode_kv_addrs"] = [f"127.0.0.1:{decode}"]
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_role": role,
        "kv_port": prefill if role == "kv_producer" else decode,
        "kv_buffer_size": "1e9",
        "kv_connector_extra_config": extra,
    }


def p2p_ids(prefill: int, decode: int, tag: str, n: int) -> list[str]:
    """``n`` request ids naming the P2P addresses (vLLM's proxy's form), ``tag`` and i."""
    return [
        f"___prefill_addr_127.0.0.1:{prefill}___decode_addr_127.0.0.1:{decode}_{tag}{i}"
        for i in range(n)
    ]


def generate_with_ids(
    engine: LLM, prompts: list[dict], ids: list[str], params: SamplingParams
) -> list:
    """``prompts``' outputs, in order, as one batch with these request ids (P2P reads its
    addresses there)."""

    async def generate() -> list:
        outs: list = [None] * len(ids)
        async with engine.engine.generate_many(prompts, [params] * len(ids), ids) as items:
            async for index, out in items:
                outs[index] = out
        return outs

    return engine._call(generate)


def run_rounds(
    engine: LLM, rounds: tuple[list[list[int]], ...], params: SamplingParams
) -> tuple[list[list[int]], list[int], SchedulerStats]:
    """(greedy tokens, cached prompt tokens, stats) of ``rounds``, each round's prompts one
    batch; the engine shut down after."""
    try:
        outs = []
        for prompts in rounds:
            outs += engine.generate([{"prompt_token_ids": p} for p in prompts], params)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return tokens, [o.num_cached_tokens for o in outs], engine.engine.get_stats()
    finally:
        engine.shutdown()


def max_logprob_diff(a, b) -> float:
    """The largest |logprob difference| of the sampled tokens of two runs' outputs."""
    return max(
        abs(x[t].logprob - y[t].logprob)
        for out_a, out_b in zip(a, b, strict=True)
        for x, y, t in zip(
            out_a.outputs[0].logprobs, out_b.outputs[0].logprobs, out_a.outputs[0].token_ids
        )
    )


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
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


@contextlib.contextmanager
def disagg_pair(
    model: str, logs: Path, prefill_kv: str, decode_kv: str, proxy_args: tuple[str, ...] = ()
) -> Iterator[tuple[ServerProcess, ServerProcess, str]]:
    """A prefill and a decode ``trillm serve`` (``SERVE_ARGS``, these --kv-transfer-config)
    behind the proxy (``proxy_args``: its further flags) -> (prefill, decode, proxy URL); each
    exits cleanly after."""
    prefill = ServerProcess(
        [model, *SERVE_ARGS, "--kv-transfer-config", prefill_kv], logs / "p.log"
    )
    decode = ServerProcess([model, *SERVE_ARGS, "--kv-transfer-config", decode_kv], logs / "d.log")
    prefill.start()
    decode.start()
    port = free_port()
    command = [sys.executable, "-m", "trillm.entrypoints.disagg_proxy", "--prefill", prefill.url]
    command += ["--decode", decode.url, "--port", str(port), *proxy_args]
    with open(logs / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(command, cwd=REPO, env=server_env(), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proxy)
    yield prefill, decode, url
    proxy.terminate()
    proxy.wait(timeout=30)
    assert prefill.stop() == 0, prefill.log()
    assert decode.stop() == 0, decode.log()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(base: str, prompt: list[int], **extra) -> tuple[str, list[float]]:
    """Greedy, 8 tokens, with logprobs (``extra``: the body's further fields) -> (text,
    logprobs)."""
    out = client(base).completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1, extra_body=extra
    )
    choice = out.choices[0]
    return choice.text, choice.logprobs.token_logprobs


def metric(server: ServerProcess, name: str) -> float:
    return metric_value(httpx.get(server.url + "/metrics").text, name)


def assert_pair_answers_as_one_instance(prefill: ServerProcess, decode: ServerProcess, proxy: str):
    """``PAIR_PROMPTS`` through the proxy: the prefill instance's own texts and logprobs, and
    the decode instance computed only each prompt's unaligned tail (the rest it loaded:
    ``vllm:external_prefix_cache_hits``)."""
    for prompt in PAIR_PROMPTS:
        text, logprobs = complete(proxy, prompt)
        alone_text, alone = complete(prefill.url, prompt)  # the prefill instance alone
        assert text == alone_text
        assert max(abs(a - b) for a, b in zip(logprobs, alone, strict=True)) < 1e-4
    moved = sum(aligned(len(p)) for p in PAIR_PROMPTS)
    assert metric(decode, "vllm:external_prefix_cache_hits_total") == moved
    computed = metric(decode, "vllm:prompt_tokens_total") - moved
    assert computed == sum(len(p) - aligned(len(p)) for p in PAIR_PROMPTS)  # the tails only


def assert_recomputed(
    decode: ServerProcess, prompt: list[int], alone: tuple[str, list[float]], **extra
) -> None:
    """The decode instance answers ``prompt`` (``extra``: the body's further fields) as
    ``alone`` (the prefill instance's text and logprobs), loading none of it."""
    hits = metric(decode, "vllm:external_prefix_cache_hits_total")
    text, logprobs = complete(decode.url, prompt, **extra)
    assert text == alone[0]
    assert max(abs(a - b) for a, b in zip(logprobs, alone[1], strict=True)) < 1e-4
    assert metric(decode, "vllm:external_prefix_cache_hits_total") == hits  # nothing loaded
