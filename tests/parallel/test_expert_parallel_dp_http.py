"""``trillm serve -dp 2 --enable-expert-parallel`` (the experts over both engine cores' ranks,
trillm/engine/dp_lockstep.py): two streams served at once, one per core, answer the
single-rank engine's greedy tokens; /metrics counts each core's (token, expert) pairs at every
expert rank; a rank killed while the other core serves ends the server with an error naming
it, the process exits 1 and leaves no worker (nor the ranks' rendezvous file) behind; SIGTERM
stops it with exit 0 and nothing left."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from expert_parallel_models import ODD_EXPERTS
from parallel_models import LIMITS
from parallel_reference import greedy_body, limit_flags, reference_tokens
from server_harness import ServerProcess, open_request, read_until
from worker_processes import core_worker_ranks, pid_alive

PROMPTS = ["The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mixtral(tiny_model_factory):
    return tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])


def start(path: str, tmp_path: Path, *more: str) -> ServerProcess:
    flags = ["-dp", "2", "--enable-expert-parallel", *more, *limit_flags(LIMITS)]
    return ServerProcess([path, *flags], tmp_path / "server.log").start()


def expert_stores(pid: int) -> list[str]:
    """The rendezvous files of the server's ranks (engine/dp_router.core_configs) left."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"trillm-experts-{pid}-*"))


def stream(server: ServerProcess, prompt: str, max_tokens: int) -> tuple[socket.socket, bytes]:
    """A greedy completion streamed with its token ids and usage; returns (the socket, what
    it has read) once the first token is out."""
    body = greedy_body(prompt, max_tokens)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    sock = open_request(server, "/v1/completions", body)
    return sock, read_until(sock, b"data: {")


def finish(opened: tuple[socket.socket, bytes]) -> bytes:
    """The whole stream, to its end."""
    sock, head = opened
    return head + read_until(sock, b"[DONE]")


def tokens_and_usage(raw: bytes) -> tuple[list[int], dict]:
    """A finished stream's generated token ids and its usage."""
    ids, usage = [], {}
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    return ids, usage


def test_two_cores_serve_at_once_and_metrics_count_each_cores_pairs(mixtral, tmp_path):
    """Each stream lands on its own core (the second sent once the first is running) and
    both run together; /metrics: every core's series at expert ranks 0 and 1, each core's
    pairs > 0, and all of them top_k (2) x MoE layers (2) x the tokens the model computed.
    SIGTERM while both cores stream again: exit 0, and no rank died in an exchange (each
    core's task, ending, still sends the dummy forwards the other's last step needs)."""
    expected = reference_tokens(mixtral, PROMPTS, MAX_TOKENS, **LIMITS)
    server = start(mixtral, tmp_path)
    try:
        ranks = core_worker_ranks(server.proc.pid)
        opened = [stream(server, prompt, MAX_TOKENS) for prompt in PROMPTS]
        raws = [finish(one) for one in opened]
        metrics = httpx.get(server.url + "/metrics", timeout=60).text
        for prompt in PROMPTS:  # stopped while both cores are in their steps
            stream(server, prompt, 48)
    finally:
        code = server.stop()
    log = server.log_path.read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert "all_to_all failed" not in log and "Traceback" not in log, log[-3000:]
    assert not any(pid_alive(pid) for pid in ranks.values())  # SIGTERM: a clean stop
    assert expert_stores(server.proc.pid) == []
    got, usages = zip(*(tokens_and_usage(raw) for raw in raws))
    assert list(got) == expected
    series = re.findall(
        r"^trillm:expert_parallel_routed_tokens_total\{(.*)\} (\S+)$", metrics, re.MULTILINE
    )
    pairs: dict[tuple[str, str], float] = {}
    for labels, value in series:
        engine = re.search(r'engine="(\d+)"', labels)[1]
        rank = re.search(r'rank="(\d+)"', labels)[1]
        pairs[engine, rank] = float(value)
    assert set(pairs) == {(e, r) for e in "01" for r in "01"}, pairs
    assert all(pairs["0", r] + pairs["1", r] > 0 for r in "01"), pairs
    assert pairs["0", "0"] + pairs["0", "1"] > 0 and pairs["1", "0"] + pairs["1", "1"] > 0
    computed = sum(u["prompt_tokens"] + u["completion_tokens"] - 1 for u in usages)
    assert sum(pairs.values()) == 2 * 2 * computed, (pairs, usages)


def test_a_killed_rank_ends_the_server_naming_it(mixtral, tmp_path):
    """Core 1's rank killed while core 0 streams (core 1 idle, sending dummy forwards): the
    stream ends with an error naming the rank, the server exits 1, no worker is left."""
    server = start(mixtral, tmp_path)
    try:
        ranks = core_worker_ranks(server.proc.pid)
        assert sorted(ranks) == [(0, 0), (1, 0)]
        opened = stream(server, PROMPTS[0], 48)
        time.sleep(0.2)
        os.kill(ranks[1, 0], signal.SIGKILL)
        tail = finish(opened)
        assert b"rank 0 of engine core 1" in tail, tail[-600:]
        assert server.proc.wait(timeout=60) == 1, server.log()
    finally:
        server.stop()
    deadline = time.monotonic() + 30
    while any(pid_alive(pid) for pid in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in ranks.values())
    assert expert_stores(server.proc.pid) == []  # removed although a rank never left
