"""The token bound on admission (``--max-num-admitted-tokens``, issue 11) on a real
``trillm serve``: every admitted sequence counts its prompt tokens plus its max_tokens; a
request that would pass the bound gets 503 + Retry-After at once, whole (n > 1 and several
prompts included); a request larger than the bound by itself gets a 400; the tokens come back
on every way out.

Prompts are token ids, so each request's count is exact. --max-num-seqs 2: two sequences run,
the rest wait. A sequence is 6,000 tokens (a tiny model of 8,192 positions), so that the ones
running outlast the test's checks on a fast host too (1,500 tokens took under 3 s on an idle
Zen 4: the request meant to wait was admitted and finished).
"""

from __future__ import annotations

import time

import httpx
import pytest
from server_harness import (
    ServerProcess,
    gauges,
    open_request,
    read_until,
    wait_gauges,
)

MAX_NUM_SEQS = 2
LIMIT = 24000
PROMPT = list(range(100, 110))  # 10 tokens
FULL = 6000 - len(PROMPT)  # max_tokens: one sequence of 6,000 tokens


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama", max_position_embeddings=8192)
    log = tmp_path_factory.mktemp("token-queue") / "server.log"
    srv = ServerProcess(
        [
            model,
            "--max-model-len",
            "8192",
            "--kv-cache-memory",
            "64MiB",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-num-admitted-tokens",
            str(LIMIT),
        ],
        log,
    ).start()
    yield srv
    srv.stop()


def completion(prompt, max_tokens: int, **extra) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


def assert_overloaded(r: httpx.Response, started: float) -> None:
    assert time.monotonic() - started < 1.0, "the 503 must come at once"
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "1"
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert "tokens" in error["message"] and str(LIMIT) in error["message"], error


def test_token_bound_refuses_whole_requests_at_once(server):
    url = server.base_url + "/completions"
    with httpx.Client(timeout=60) as client:
        # 18,000 of 24,000 tokens taken: one prompt, then two (a fan-in), streamed.
        socks = [
            open_request(server, "/v1/completions", completion(prompt, FULL, stream=True))
            for prompt in (PROMPT, [PROMPT, PROMPT])
        ]
        try:
            # (the fan-in has one prompt in the engine at a time here, the other waits in the
            # frontend: fair admission, 3/4 of --max-num-seqs 2; its tokens are admitted whole)
            wait_gauges(server, (MAX_NUM_SEQS, 0))
            # 6,000 left: n=2 and two prompts needing 6,020 / 6,022 are refused whole.
            for body in (completion(PROMPT, 3000, n=2), completion([PROMPT, PROMPT], 3001)):
                started = time.monotonic()
                assert_overloaded(client.post(url, json=body), started)
            assert gauges(server) == (MAX_NUM_SEQS, 0)  # nothing of them reached the engine
            # Larger than the bound by itself: never admitted, so a 400, not a 503.
            r = client.post(url, json=completion(PROMPT, FULL, n=5))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "max_tokens"
            assert "--max-num-admitted-tokens" in r.json()["error"]["message"]
            # Exactly the 6,000 left: admitted (it waits; its own timeout ends it).
            last = open_request(
                server, "/v1/completions", completion(PROMPT, FULL, stream=True, timeout=3)
            )
            socks.append(last)
            wait_gauges(server, (MAX_NUM_SEQS, 1))
            # Full: even one more token is refused in the gate, before the body is read.
            started = time.monotonic()
            r = client.post(
                url, content=b'{"not": "a request"}', headers={"Content-Type": "application/json"}
            )
            assert_overloaded(r, started)
            assert b'"finish_reason":"timeout"' in read_until(last, b"[DONE]")
        finally:
            for sock in socks:
                sock.close()  # the clients leave mid-stream
        wait_gauges(server, (0.0, 0.0))
        # Every token came back (finish, timeout, disconnects): the whole bound fits again,
        # four prompts of 6,000 (two of them wait; the timeout ends all four).
        r = client.post(url, json=completion([PROMPT] * 4, FULL, timeout=1))
        assert r.status_code == 200, r.text
        assert {c["finish_reason"] for c in r.json()["choices"]} == {"timeout"}
        r = client.post(url, json=completion(PROMPT, 3))
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 13, r.text


def test_flag_is_validated(capsys):
    from trillm.entrypoints.cli.main import build_parser
    from trillm.entrypoints.cli.serve_args import server_options

    def options(*flags: str):
        return server_options(build_parser().parse_args(["serve", *flags]))

    assert options().max_num_admitted_tokens is None  # default: no bound
    assert options("--max-num-admitted-tokens", "4096").max_num_admitted_tokens == 4096
    for bad in ("0", "-1", "1.5", "many"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--max-num-admitted-tokens", bad])
        assert "max-num-admitted-tokens" in capsys.readouterr().err
