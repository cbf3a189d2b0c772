"""Faults around a request's life on a real ``trillm serve`` (issue 11): huge prompts, the
per-request ``timeout``, the queue bound (--max-num-queued-requests), clients that leave
before their first token followed by SIGTERM, and a worker that dies.

One server serves the module (--max-num-seqs 2: two requests run, the rest wait); the last
test stops it. The dead-engine test starts its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from server_harness import ServerProcess, open_request, read_until, wait_gauges, worker_pids

MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 2
MAX_QUEUED = 8
LONG = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    log = tmp_path_factory.mktemp("lifecycle-faults") / "server.log"
    srv = ServerProcess(
        [
            model,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory",
            "64MiB",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-num-queued-requests",
            str(MAX_QUEUED),
            "--shutdown-timeout",
            "120",
        ],
        log,
    ).start()
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.stop()


# ---------------------------------------------------------------- helpers


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def serves(srv: ServerProcess) -> None:
    ok = httpx.post(
        srv.base_url + "/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- huge prompts


def test_huge_prompt_refused_before_tokenizing(server):
    """A 6 MB prompt would cost the tokenizer ~1 GB; it is refused from its length alone,
    on every route that tokenizes, at once and with the context length named."""
    import trio

    text = "The quick brown fox jumps over the lazy dog. " * (6_000_000 // 45)
    bodies = [
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/tokenize", {"prompt": text}),
        ("/v1/completions", {"prompt": ["short", text], "max_tokens": 1}),
    ]
    serves(server)
    before = rss_kib(server.proc.pid)
    answers: list[httpx.Response] = []

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async with trio.open_nursery() as nursery:
                for path, body in bodies * 2:

                    async def one(path: str = path, body: dict = body) -> None:
                        answers.append(await client.post(path, json=body))

                    nursery.start_soon(one)

    start = time.monotonic()
    trio.run(main)
    elapsed = time.monotonic() - start
    grown_mib = (rss_kib(server.proc.pid) - before) / 1024
    for r in answers:
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
        assert error["type"] == "BadRequestError"
    assert elapsed < 10, elapsed
    assert grown_mib < 80, f"server RSS grew by {grown_mib:.0f} MiB"
    # Under the character bound a text is tokenized (in a tokenizer thread past 20,000
    # characters) and counted, as vLLM's /tokenize does, even beyond the context.
    for words in (1500, 30_000):
        r = httpx.post(server.url + "/tokenize", json={"prompt": "word " * words}, timeout=60)
        assert r.status_code == 200 and r.json()["count"] >= words, r.text[:300]
    serves(server)


# ---------------------------------------------------------------- per-request timeout


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_ends_request(server, stream):
    body = {"prompt": "tick", "timeout": 0.4, "stream": stream, **LONG}
    start = time.monotonic()
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    elapsed = time.monotonic() - start
    assert r.status_code == 200, r.text
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        reasons = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert reasons[-1] == "timeout" and reasons.count("timeout") == 1
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    else:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "timeout"
        text = choice["text"]
        assert 0 < r.json()["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert text  # what was generated before the deadline is kept
    assert elapsed < 0.4 + 3, elapsed
    wait_gauges(server, (0.0, 0.0))
    serves(server)


def test_timeout_in_chat(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "timeout": 0.4, **LONG}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "timeout"
    wait_gauges(server, (0.0, 0.0))


def test_generate_timeout_python_api(tiny_model_factory):
    """``AsyncEngine.generate(timeout=)``: the last output says "timeout", n > 1 included,
    and the engine is left with nothing unfinished."""
    import trio

    from trillm import SamplingParams, open_engine
    from trillm.executor.abstract import FAKE_RUNNER

    async def main() -> None:
        async with open_engine(
            tiny_model_factory("llama"),
            runner=FAKE_RUNNER,
            runner_kwargs={"step_sleep_s": 0.01},
            max_model_len=2048,
        ) as engine:
            params = SamplingParams(max_tokens=1000, ignore_eos=True, n=2)
            start = trio.current_time()
            stream = engine.generate({"prompt_token_ids": [1, 2]}, params, timeout=0.3)
            async with stream as outputs:
                outs = [o async for o in outputs]
            assert trio.current_time() - start < 2
            last = outs[-1]
            assert last.finished
            assert [c.finish_reason for c in last.outputs] == ["timeout", "timeout"]
            assert all(0 < len(c.token_ids) < 1000 for c in last.outputs)
            assert not engine.output_processor.has_unfinished_requests()
            with pytest.raises(ValueError, match="timeout"):
                async with engine.generate({"prompt_token_ids": [1]}, timeout=0):
                    pass

    trio.run(main)


def test_timeout_is_validated(server):
    for bad in (0, -1, 1e9, "soon"):
        r = httpx.post(
            server.base_url + "/completions", json={"prompt": "x", "timeout": bad}, timeout=60
        )
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "timeout"


# ---------------------------------------------------------------- queue bound


def test_full_queue_answers_503_at_once(server):
    """2 running + 7 waiting of 10 admitted: n=2 and two prompts are refused whole, one more
    request is admitted; then a full queue refuses even a body it never reads."""
    limit = MAX_NUM_SEQS + MAX_QUEUED
    socks = [
        open_request(server, "/v1/completions", {"prompt": f"fill {i}", "stream": True, **LONG})
        for i in range(limit - 1)
    ]
    try:
        wait_gauges(server, (MAX_NUM_SEQS, limit - 1 - MAX_NUM_SEQS))
        url = server.base_url + "/completions"
        for body in (
            {"prompt": "pair", "n": 2, "max_tokens": 2},
            {"prompt": ["one", "two"], "max_tokens": 2},
        ):
            start = time.monotonic()
            r = httpx.post(url, json=body, timeout=60)
            assert time.monotonic() - start < 1.0
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
            assert "overloaded" in r.json()["error"]["message"]
        # The last place: admitted (it waits, and its own timeout ends it there).
        last = open_request(
            server, "/v1/completions", {"prompt": "last", "timeout": 3, "stream": True, **LONG}
        )
        socks.append(last)
        wait_gauges(server, (MAX_NUM_SEQS, limit - MAX_NUM_SEQS))
        start = time.monotonic()
        r = httpx.post(
            url,
            content=b'{"not": "a request"}',
            timeout=60,
            headers={"Content-Type": "application/json"},
        )
        assert time.monotonic() - start < 1.0
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert b'"finish_reason":"timeout"' in read_until(last, b"[DONE]")
    finally:
        for sock in socks:
            sock.close()
    wait_gauges(server, (0.0, 0.0))
    serves(server)


# ---------------------------------------------------------------- early disconnects, SIGTERM


def test_early_disconnects_then_sigterm_exits_at_once(server):
    """Last test of the module: clients that leave before their first token (one prompt and
    several, streamed and not) leave nothing behind; SIGTERM on the idle server then exits
    with 0 at once, not after --shutdown-timeout (120 s)."""
    blockers = [
        open_request(server, "/v1/completions", {"prompt": f"b{i}", "stream": True, **LONG})
        for i in range(MAX_NUM_SEQS)
    ]
    for sock in blockers:
        read_until(sock, b"data: {")
    early = [
        ("/v1/completions", {"prompt": "one", **LONG}),
        ("/v1/completions", {"prompt": "one streamed", "stream": True, **LONG}),
        ("/v1/completions", {"prompt": ["two", "prompts"], **LONG}),
        ("/v1/completions", {"prompt": ["two", "streamed"], "stream": True, **LONG}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **LONG}),
    ]
    socks = [open_request(server, path, body) for path, body in early]
    # All waiting, none has a token yet: 5 engine requests, as a two-prompt request has one
    # prompt in the engine at a time here (fair admission: 3/4 of --max-num-seqs 2).
    wait_gauges(server, (MAX_NUM_SEQS, 5))
    for sock in socks:
        sock.close()
    wait_gauges(server, (MAX_NUM_SEQS, 0))
    for sock in blockers:
        sock.close()
    wait_gauges(server, (0.0, 0.0))
    # The streams whose body never ran are no longer counted either (exchange.py).
    assert httpx.get(server.url + "/load", headers=server.headers()).json() == {"server_load": 0}
    time.sleep(0.3)
    start = time.monotonic()
    server.terminate()
    try:
        code = server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"SIGTERM on an idle server did not exit in 20 s:\n{server.log()}")
    assert code == 0, server.log()
    assert time.monotonic() - start < 8, server.log()
    assert "Draining 0 running request(s)" in server.log()
    assert "Shutdown cancelled" not in server.log()  # nothing was left to cancel


# ---------------------------------------------------------------- a dead engine


def test_dead_engine_exits_non_zero(tiny_model_factory, tmp_path):
    """The worker killed under two requests: both get an error (SSE event, HTTP 503), then
    the process exits by itself with code 1 within a few seconds, saying why."""
    model = tiny_model_factory("llama")
    srv = ServerProcess(
        [model, "--max-model-len", "1024", "--kv-cache-memory", "16MiB"], tmp_path / "s.log"
    ).start()
    try:
        workers = worker_pids(srv.proc.pid)
        assert workers, "expected a model-worker subprocess"
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
        streamed = open_request(srv, "/v1/completions", {**body, "stream": True})
        read_until(streamed, b"data: {")
        plain = open_request(srv, "/v1/completions", body)
        time.sleep(0.2)
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        tail = read_until(streamed, b"[DONE]")
        assert b"ServiceUnavailableError" in tail
        answer = read_until(plain, b"}}")
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        code = srv.proc.wait(timeout=15)
        assert time.monotonic() - killed < 10
    finally:
        code = srv.stop()
    assert code == 1, srv.log()
    assert "The engine died" in srv.log()


def test_dead_engine_restarts_with_flag(tiny_model_factory, tmp_path):
    """--restart-on-engine-death: the stream in flight gets its error, a new engine (a new
    worker) comes up in the same process and serves; SIGTERM then exits with 0."""
    model = tiny_model_factory("llama")
    srv = ServerProcess(
        [
            model,
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "16MiB",
            "--restart-on-engine-death",
        ],
        tmp_path / "s.log",
    ).start()
    try:
        (worker,) = worker_pids(srv.proc.pid)
        streamed = open_request(
            srv,
            "/v1/completions",
            {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True},
        )
        read_until(streamed, b"data: {")
        os.kill(worker, signal.SIGKILL)
        assert b"ServiceUnavailableError" in read_until(streamed, b"[DONE]")
        deadline = time.monotonic() + 120
        while "restart 1" not in srv.log() or httpx.get(srv.url + "/health").status_code != 200:
            assert srv.proc.poll() is None, srv.log()
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.2)
        assert "restarting it (--restart-on-engine-death)" in srv.log()
        assert worker_pids(srv.proc.pid) not in ([], [worker])
        serves(srv)
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
