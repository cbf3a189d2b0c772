"""A client that stops reading its stream (issue 11, "clients that do not read their stream"),
on a real ``trillm serve``: the server does not hold ever more output for it. Once what it left
unread passes ``MAX_UNREAD_UNITS`` its request is aborted in the engine (one warning naming
it) while its socket is still open; when it reads again it gets what was held, then the final
'abort' chunk and ``[DONE]``. A client streaming beside it is served in full.

Fake runner (near-zero model cost: the output side is what is measured), the tiny llama's
tokenizer. The stuck request asks n=32, 20 logprobs, 2,000 tokens: 1.3 M units, ~200 MB of
Python objects if it were held to the end (the server's RSS grew that much before the bound).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import ServerProcess, fake_llama_args, metric_value

from trillm.engine.output_collector import MAX_UNREAD_UNITS

STUCK_ID = "stuck-reader-1"
STUCK = {
    "prompt": "tell me everything",
    "n": 32,
    "logprobs": 20,
    "max_tokens": 2000,
    "ignore_eos": True,
    "stream": True,
    "request_id": STUCK_ID,
}
# What the stuck request would produce in all (units: tokens x (1 + logprobs)).
STUCK_UNITS = 32 * 2000 * 21


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    log = tmp_path_factory.mktemp("slow-reader") / "server.log"
    srv = ServerProcess(
        # The stuck request's 1.3 M logprob entries pass the per-request budget (2**20 by
        # default): what is bounded here is what its reader leaves unread.
        fake_llama_args(tiny_model_factory("llama"), "--max-logprob-entries", "2000000"),
        log,
    ).start()
    yield srv
    srv.stop()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def running(srv: ServerProcess) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return metric_value(text, "trillm:num_requests_running")


def open_stuck_stream(srv: ServerProcess) -> socket.socket:
    """The request on a raw socket with a small receive buffer, never read (for now)."""
    data = json.dumps(STUCK).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # before connect: the window
    sock.settimeout(60)
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(head.encode() + data)
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    seen = bytearray()
    while not seen.endswith(b"data: [DONE]\n\n") and not seen.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(1 << 20)
        assert chunk, f"connection closed early: {bytes(seen[-300:])!r}"
        seen += chunk
    return bytes(seen)


def test_stuck_reader_is_aborted_and_memory_stays_bounded(server):
    assert STUCK_UNITS > 8 * MAX_UNREAD_UNITS  # held to the end, it would pass the bound
    url = server.base_url + "/completions"
    warm = httpx.post(
        url, json={"prompt": "warm up", "max_tokens": 50, "logprobs": 20, "n": 8}, timeout=60
    )
    assert warm.status_code == 200, warm.text
    pid = server.proc.pid
    baseline = rss_mib(pid)
    peak = baseline
    stop_sampling = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop_sampling.is_set():
            peak = max(peak, rss_mib(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stuck = open_stuck_stream(server)
    try:
        # Another client streams normally meanwhile and gets all of its tokens.
        normal = {
            "prompt": "a normal client",
            "max_tokens": 300,
            "ignore_eos": True,
            "logprobs": 5,
            "n": 2,
            "stream": True,
        }
        chunks = 0
        reasons: list[str] = []
        with httpx.stream("POST", url, json=normal, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("finish_reason"):
                            reasons.append(choice["finish_reason"])
        assert reasons == ["length", "length"] and chunks > 2
        # The stuck request ends in the engine while its socket is still open.
        deadline = time.monotonic() + 60
        while running(server) != 0:
            assert time.monotonic() < deadline, "the stuck request was never aborted"
            time.sleep(0.1)
        time.sleep(1.0)  # nothing keeps growing after the abort
        stop_sampling.set()
        sampler.join()
        growth = peak - baseline
        # Held: at most MAX_UNREAD_UNITS of output (~20 MB) plus what is being written; the
        # whole request would be ~200 MB.
        assert growth < 80, f"server RSS grew {growth:.0f} MiB ({baseline:.0f} -> {peak:.0f})"
        warnings = [line for line in server.log().splitlines() if "stopped reading" in line]
        assert len(warnings) == 1 and STUCK_ID in warnings[0], warnings
        # Reading again: what was held, then the final 'abort' and [DONE].
        body = read_to_end(stuck)
        assert b'"finish_reason":"abort"' in body, body[-600:]
        assert b'"finish_reason":"length"' not in body
        assert body.endswith(b"data: [DONE]\n\n") or b"data: [DONE]" in body[-200:]
    finally:
        stop_sampling.set()
        stuck.close()
    # The server is fine afterwards.
    ok = httpx.post(url, json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_reading_client_is_never_cut(server):
    """The heavy end of what a reading client asks (n=64, 20 logprobs: 1,344 units a step, 4x
    the bound in all) on a model with no cost, so the output side is the bottleneck: the
    client keeps up and gets every token."""
    body = {
        "prompt": "read it all",
        "n": 64,
        "logprobs": 20,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "request_id": "heavy-reader",
    }
    assert 64 * 400 * 21 > 4 * MAX_UNREAD_UNITS
    tokens = [0] * 64
    reasons: list[str] = []
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens[choice["index"]] += len(choice["logprobs"]["tokens"])
                    if choice.get("finish_reason"):
                        reasons.append(choice["finish_reason"])
    assert reasons == ["length"] * 64 and tokens == [400] * 64
    assert "heavy-reader" not in server.log()
