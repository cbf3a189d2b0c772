"""KV-cache oversubscription over HTTP (issue 11): many long requests on a KV cache that holds
about two of them at once. The scheduler must preempt (free a request's blocks, recompute it
later) instead of failing or stalling anyone: every request completes, its greedy output equals
the same request served alone on an idle server, /metrics counts the preemptions, and
running/waiting/KV usage return to 0.

The real embedded default model runs (``trillm serve`` with no MODEL argument); the cache is
16 blocks of 16 tokens (--num-gpu-blocks-override), the context 256 tokens, so one request
always fits alone and ten never fit together.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from server_harness import ServerProcess, metric_value

NUM_BLOCKS = 16
BLOCK_SIZE = 16
MAX_TOKENS = 72
# Distinct openings (no shared prefix, so the prefix cache cannot stand in for the KV blocks).
PROMPTS = [
    "In the beginning God created",
    "The quick brown fox jumps over",
    "Once upon a time there lived a king",
    "And the LORD spake unto Moses, saying",
    "Blessed are the meek, for",
    "Numbers: one, two, three, four,",
    "The sea was calm and the ships",
    "Hear, O Israel: the LORD our God",
    "My soul doth magnify",
    "Then came the twelfth day of the month",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("kv-oversubscription") / "server.log"
    srv = ServerProcess(
        [
            "--num-gpu-blocks-override",
            str(NUM_BLOCKS),
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(NUM_BLOCKS * BLOCK_SIZE),
            "--max-num-seqs",
            "16",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def complete(client: httpx.Client, prompt: str) -> dict:
    r = client.post(
        "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def metrics(srv: ServerProcess) -> str:
    return httpx.get(srv.url + "/metrics", timeout=10).text


def test_oversubscribed_requests_all_complete_as_if_alone(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        alone = [complete(client, p) for p in PROMPTS]
        before = metric_value(metrics(server), "trillm:num_preemptions_total")
        assert before == 0, "one request at a time must fit without preemption"

        together: list[dict | None] = [None] * len(PROMPTS)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                together[i] = complete(client, PROMPTS[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a request never finished"

    page = metrics(server)
    preemptions = metric_value(page, "trillm:num_preemptions_total")
    assert preemptions > 0, "the tiny KV cache should have forced preemption"
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b is not None
        choice = b["choices"][0]
        assert choice["finish_reason"] == "length", choice
        assert b["usage"]["completion_tokens"] == MAX_TOKENS
        assert choice["text"] == a["choices"][0]["text"], f"request {i} diverged under preemption"
    assert metric_value(page, "trillm:num_requests_running") == 0
    assert metric_value(page, "trillm:num_requests_waiting") == 0
    assert metric_value(page, "trillm:kv_cache_usage_perc") == 0
