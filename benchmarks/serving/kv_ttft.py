"""What the KV TTFT benchmarks share (``kv_transfer_ttft.py``, ``kv_offload_ttft.py``,
``pd_ttft.py``): a ``--kv-transfer-config`` for a prefill / decode pair of either connector,
the two servers, fresh random prompts, a streamed request's TTFT, a round of the two figures in
alternating order (a shared, loaded machine), and the servers' Prometheus samples."""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from benchmarks.common import PROMPT_ID_RANGE, free_port, trillm_server


def kv_configs(connector: str, folder: str | None = None) -> tuple[str, str, str | None]:
    """(prefill's --kv-transfer-config, decode's, the head of the request ids naming the KV
    addresses, as vLLM's proxy writes them, or None) for ``connector``: ``shared_storage``
    (vLLM's SharedStorageConnector on ``folder``, a fresh temporary one by default), ``p2p``
    (its P2pNcclConnector, "GET", on a free local port; the consumer lists the prefill
    instance's address), ``p2p_put`` / ``p2p_put_async`` (send_type "PUT" / "PUT_ASYNC": the
    producer pushes to the consumer's free local port, each listing the other)."""
    if connector == "shared_storage":
        path = folder or tempfile.mkdtemp(prefix="pd-ttft-")
        base = {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": path},
        }
        return (
            json.dumps({**base, "kv_role": "kv_producer"}),
            json.dumps({**base, "kv_role": "kv_consumer"}),
            None,
        )
    send_type = {"p2p": "GET", "p2p_put": "PUT", "p2p_put_async": "PUT_ASYNC"}[connector]
    prefill, decode = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    producer_extra: dict[str, Any] = {"send_type": send_type}
    if send_type != "GET":  # the producer pushes to the listed consumer only
        producer_extra["decode_kv_addrs"] = [decode]
    roles = (
        ("kv_producer", prefill, producer_extra),
        ("kv_consumer", decode, {"send_type": send_type, "prefill_kv_addrs": [prefill]}),
    )
    configs = [
        json.dumps(
            {
                "kv_connector": "P2pNcclConnector",
                "kv_role": role,
                "kv_ip": "127.0.0.1",
                "kv_port": int(address.rsplit(":", 1)[1]),
                "kv_buffer_size": 1e9,
                "kv_connector_extra_config": extra,
            }
        )
        for role, address, extra in roles
    ]
    return configs[0], configs[1], f"___prefill_addr_{prefill}___decode_addr_{decode}_"


@contextlib.contextmanager
def prefill_decode(
    model: str, args: Sequence[str], prefill_kv: str, decode_kv: str
) -> Iterator[tuple[str, str]]:
    """A kv_producer and a kv_consumer ``trillm serve`` -> (prefill URL, decode URL)."""
    with (
        trillm_server(model, [*args, "--kv-transfer-config", prefill_kv]) as (prefill, _),
        trillm_server(model, [*args, "--kv-transfer-config", decode_kv]) as (decode, _),
    ):
        yield prefill, decode


def random_prompts(rng: random.Random, length: int, count: int) -> list[list[int]]:
    return [[rng.randrange(*PROMPT_ID_RANGE) for _ in range(length)] for _ in range(count)]


def complete(url: str, prompt: list[int], timeout: float = 300, **extra: Any) -> None:
    """One token (max_tokens 1): the prompt's KV computed, stored or served."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, **extra}
    httpx.post(url + "/v1/completions", json=body, timeout=timeout).raise_for_status()


def ttft_s(
    url: str, prompt: list[int], request_id: str | None = None, timeout: float = 300
) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}
    body.update(temperature=0.0, **({} if request_id is None else {"request_id": request_id}))
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


def alternating(i: int, order: list[Any]) -> list[Any]:
    """Round ``i``'s order: as given in even rounds, reversed in odd ones."""
    return order if i % 2 == 0 else order[::-1]


def metric(url: str, name: str) -> float:
    """The first sample of ``name``."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def metrics(url: str, prefix: str) -> dict[str, float]:
    """Every sample whose name starts with ``prefix`` -> its value."""
    found = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found
