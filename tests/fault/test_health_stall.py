"""``/health`` tells a stopped worker from a busy one: a real ``trillm serve`` whose model worker
is SIGSTOPped under a stream answers 503 once the step has run past ``--health-step-timeout``
(before: 200 for the executor's whole 300 s step timeout), and 200 again once the worker
continues, the stream losing nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_harness import REPO, ServerProcess, open_request, read_until, worker_pids

FAKE = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]
STEP_TIMEOUT_S = 1.5


def _health(srv: ServerProcess) -> httpx.Response:
    return httpx.get(srv.url + "/health", timeout=10)


def _wait_health(srv: ServerProcess, status: int, within: float) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    while True:
        answer = _health(srv)
        waited = time.monotonic() - start
        if answer.status_code == status or waited > within:
            return answer, waited
        time.sleep(0.1)


@pytest.fixture
def server(tmp_path):
    srv = ServerProcess(
        [*FAKE, "--health-step-timeout", str(STEP_TIMEOUT_S)], tmp_path / "server.log"
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_a_stopped_worker_turns_health_503_and_back(server):
    (worker,) = worker_pids(server.proc.pid)
    body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
    busy = open_request(server, "/v1/completions", body)
    read_until(busy, b"data: {")
    assert _health(server).status_code == 200  # busy is healthy
    read_until(busy, b"data: [DONE]")
    # Stopped while idle, the worker's next step (this stream's first) never ends.
    os.kill(worker, signal.SIGSTOP)
    try:
        stopped = time.monotonic()  # (the step starts later: the request is not sent yet)
        stream = open_request(server, "/v1/completions", body)
        answer, _ = _wait_health(server, 503, within=STEP_TIMEOUT_S + 20)
        assert answer.status_code == 503, answer.text
        assert time.monotonic() - stopped >= STEP_TIMEOUT_S * 0.95  # not before its bound
        message = answer.json()["error"]["message"]
        assert "has not finished a step in" in message and "engine core 0" in message
        assert answer.headers["Retry-After"] == "1"
        time.sleep(0.5)
        assert _health(server).status_code == 503  # still stopped: still 503
    finally:
        os.kill(worker, signal.SIGCONT)
    answer, _ = _wait_health(server, 200, within=20)
    assert answer.status_code == 200, answer.text
    tail = read_until(stream, b"data: [DONE]")
    stream.close()
    assert b"error" not in tail
    log = server.log()
    assert log.count("has not finished a step in") == 1, log  # one warning per stall
    assert "/health answers 200 again" in log
    # The server kept serving throughout: a plain request now.
    done = httpx.post(
        server.base_url + "/completions", json={"prompt": "x", "max_tokens": 4}, timeout=60
    )
    assert done.status_code == 200 and json.loads(done.text)["choices"][0]["text"]


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_the_flag_is_validated(value):
    out = subprocess.run(
        [sys.executable, "-m", "trillm", "serve", "--health-step-timeout", value],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--health-step-timeout" in out.stderr, out.stderr
