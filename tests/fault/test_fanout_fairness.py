"""Fan-out requests (many prompts x ``n``) on a real ``trillm serve`` (issue 33, item 7): a
request's sequences are bounded (``--max-sequences-per-request``, a 400 naming it), and a
request sent after a large fan-out is not queued behind all of it: the frontend keeps at most
3/4 of the engine's batch (``--max-num-seqs``) of one request in the engine and submits its
other prompts as those end, so a later request takes a free place at once.

Fake runner (each step costs the frontend's work only), ``--max-num-seqs 16``: one request
has at most 12 sequences in the engine. Before fair admission the 96 sequences of the fan-out
below all went into the engine's FCFS queue at once, and the short request waited for six
batches of them (measured: as long as the fan-out itself).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_harness import (
    ServerProcess,
    fake_llama_args,
    gauges,
    open_request,
    read_until,
    wait_gauges,
)

MAX_NUM_SEQS = 16
PROMPTS, N, TOKENS = 24, 4, 120  # the fan-out: 96 sequences, 6 x the batch
FAN_OUT = {
    "prompt": [f"fan out prompt {i}" for i in range(PROMPTS)],
    "n": N,
    "max_tokens": TOKENS,
    "ignore_eos": True,
    "request_id": "fan-out-1",
}
SMALL = {"prompt": "a short request", "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    log = tmp_path_factory.mktemp("fanout") / "server.log"
    srv = ServerProcess(
        fake_llama_args(tiny_model_factory("llama"), "--max-num-seqs", str(MAX_NUM_SEQS)),
        log,
    ).start()
    yield srv
    srv.stop()


def post(srv: ServerProcess, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(srv.base_url + "/completions", json=body, timeout=timeout)


def test_sequences_over_the_budget_are_refused_at_once(server):
    # The attack's shape: 128 prompts x n = 64 (8,192 sequences; each field within its limit).
    body = {"prompt": [f"p{i}" for i in range(128)], "n": 64, "max_tokens": 16}
    start = time.monotonic()
    r = post(server, body, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert time.monotonic() - start < 10
    err = r.json()["error"]
    assert err["param"] == "n"
    assert "8192 sequences" in err["message"]
    assert "--max-sequences-per-request" in err["message"] and "1024" in err["message"]
    assert gauges(server) == (0, 0)  # nothing reached the engine
    # Exactly the budget is served, every choice in its place.
    body = {"prompt": [[100 + i] for i in range(16)], "n": 64, "max_tokens": 1}
    r = post(server, body)
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(1024))
    assert r.json()["usage"]["completion_tokens"] == 1024


def test_a_later_small_request_is_not_queued_behind_a_fan_out(server):
    alone_start = time.monotonic()
    assert post(server, SMALL).status_code == 200
    alone = time.monotonic() - alone_start
    result: dict = {}

    def fan_out() -> None:
        start = time.monotonic()
        result["response"] = post(server, FAN_OUT, timeout=300)
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=fan_out)
    thread.start()
    time.sleep(0.5)  # the fan-out is in the engine
    start = time.monotonic()
    small = post(server, SMALL, timeout=300)
    small_s = time.monotonic() - start
    thread.join()
    assert small.status_code == 200
    big = result["response"]
    assert big.status_code == 200, big.text[:300]
    # Before: the small request waited for the whole fan-out (small_s ~ the fan-out's time).
    assert small_s < 0.3 * result["seconds"], (small_s, result["seconds"], alone)
    # The fan-out's answer is whole and in order; served again alone, it is the same.
    body = big.json()
    assert [c["index"] for c in body["choices"]] == list(range(PROMPTS * N))
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == PROMPTS * N * TOKENS
    again = post(server, FAN_OUT, timeout=300).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]
    assert again["usage"] == body["usage"]


def test_a_client_leaving_a_fan_out_releases_all_of_it(server):
    body = {**FAN_OUT, "max_tokens": 2000, "stream": True, "request_id": "fan-out-gone"}
    sock = open_request(server, "/v1/completions", body)
    read_until(sock, b'"text"')  # generating
    sock.close()
    wait_gauges(server, (0, 0), within=20)
    time.sleep(1.0)  # no later wave of it is submitted after the client left
    assert gauges(server) == (0, 0)
    assert post(server, SMALL).status_code == 200
