"""Server lifecycle on a real ``trillm serve``: --api-key, clients that disconnect mid-stream
(their requests must be aborted in the engine), SIGTERM draining with exit code 0, and a port
in use reported before the model loads."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from server_harness import REPO, ServerProcess, metric_value

KEY = "sk-test-key"
NUM_CLIENTS = 32


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    # 16,384 positions: the drained stream outlasts --shutdown-timeout on a fast host too
    model = tiny_model_factory("llama", max_position_embeddings=16384)
    log = tmp_path_factory.mktemp("server-lifecycle") / "server.log"
    srv = ServerProcess(
        [
            model,
            "--max-model-len",
            "16384",
            "--kv-cache-memory",
            "64MiB",
            "--max-num-seqs",
            "64",
            "--shutdown-timeout",
            "2",
            "--trust-request-chat-template",
            "--stream-interval",
            "3",
        ],
        log,
        api_key=KEY,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def scheduler_gauges(srv: ServerProcess) -> tuple[float, float, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return tuple(
        metric_value(text, f"trillm:{name}")
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    )


def aborted(srv: ServerProcess) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("trillm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_started_server_froze_its_startup_heap(server):
    # trillm/gc_heap.py: the API server's objects at the end of its start are out of the
    # collector before it listens (an oldest-generation collection over them paused it
    # 160-220 ms every few seconds under load)
    log = server.log()
    frozen = re.search(
        r"API server: (\d+) startup objects frozen out of the garbage collector", log
    )
    assert frozen is not None and int(frozen.group(1)) > 50_000, log
    assert log.index("startup objects frozen") < log.index("trillm is serving"), log


def test_api_key_guards_v1_routes(server):
    url = server.base_url
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.get(url + "/models").status_code == 401
    wrong = httpx.get(url + "/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "AuthenticationError"
    assert httpx.post(url + "/completions", json=body).status_code == 401
    assert httpx.post(url + "/chat/completions", json=body).status_code == 401
    assert httpx.get(url + "/models", headers=server.headers()).status_code == 200
    ok = httpx.post(url + "/completions", json=body, headers=server.headers(), timeout=60)
    assert ok.status_code == 200, ok.text
    for open_path in ("/health", "/metrics"):
        assert httpx.get(server.url + open_path).status_code == 200


def test_trusted_request_chat_template_is_sandboxed(server):
    messages = [{"role": "user", "content": "hello there"}]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "return_token_ids": True,
        "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
    }
    r = httpx.post(
        server.base_url + "/chat/completions", json=body, headers=server.headers(), timeout=60
    )
    assert r.status_code == 200, r.text
    expected = httpx.post(
        server.url + "/tokenize", json={"prompt": "[hello there]"}, headers=server.headers()
    ).json()
    assert r.json()["prompt_token_ids"] == expected["tokens"]
    body["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    r = httpx.post(server.base_url + "/chat/completions", json=body, headers=server.headers())
    assert r.status_code == 400
    assert "chat template" in r.json()["error"]["message"]


async def _stream_then_leave(srv: ServerProcess, i: int, started, leave: trio.Event) -> None:
    """A streamed completion on a raw connection, closed after its third event. Raw: an
    httpx stream left midway leaves its nested async generators to the garbage collector."""
    body = json.dumps(
        {
            "prompt": f"client {i} says",
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    fields = {"Host": "127.0.0.1", "Content-Type": "application/json", **srv.headers()}
    head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    request = f"POST /v1/completions HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n\r\n"
    async with await trio.open_tcp_stream("127.0.0.1", srv.port) as stream:
        await stream.send_all(request.encode() + body)
        seen = b""
        while seen.count(b"data: {") < 3:
            chunk = await stream.receive_some()
            assert chunk, f"closed before the third event: {seen[-300:]!r}"
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200 "), seen[:300]
        started()
        await leave.wait()
    # leaving the block closed the connection mid-stream


def test_disconnected_streams_are_aborted(server):
    aborted_before = aborted(server)
    seen = {}

    async def main():
        leave = trio.Event()
        count = 0
        all_started = trio.Event()

        def started():
            nonlocal count
            count += 1
            if count == NUM_CLIENTS:
                all_started.set()

        async with trio.open_nursery() as nursery:
            for i in range(NUM_CLIENTS):
                nursery.start_soon(_stream_then_leave, server, i, started, leave)
            with trio.fail_after(120):
                await all_started.wait()
            seen["mid"] = await trio.to_thread.run_sync(scheduler_gauges, server)
            leave.set()

    trio.run(main)
    running, waiting, kv = seen["mid"]
    assert running + waiting == NUM_CLIENTS
    assert kv > 0
    deadline = time.monotonic() + 15
    while scheduler_gauges(server) != (0.0, 0.0, 0.0):
        assert time.monotonic() < deadline, scheduler_gauges(server)
        time.sleep(0.2)
    assert aborted(server) - aborted_before == NUM_CLIENTS
    # The engine still serves.
    ok = httpx.post(
        server.base_url + "/completions",
        json={"prompt": "after", "max_tokens": 3},
        headers=server.headers(),
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_stream_interval_sends_fewer_larger_chunks(server):
    """--stream-interval 3: the first token at once, then chunks of 3 tokens, the rest at the
    end; the streamed text equals the non-streamed one."""
    import json

    body = {
        "prompt": "In the",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    full = httpx.post(
        server.base_url + "/completions", json=body, headers=server.headers(), timeout=60
    ).json()["choices"][0]
    sizes, text = [], ""
    with httpx.stream(
        "POST",
        server.base_url + "/completions",
        json={**body, "stream": True},
        headers=server.headers(),
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("token_ids"):
                    sizes.append(len(choice["token_ids"]))
                text += choice["text"]
    assert text == full["text"]
    assert sum(sizes) == 10
    # The first token is sent at once and then every third, but a loaded host may hand the
    # output handler two steps' tokens together (merged into one chunk, as vLLM's collector
    # merges them): so no chunk between the first and the last is smaller than the interval,
    # and there are fewer chunks than tokens.
    assert all(n >= 3 for n in sizes[1:-1]) and len(sizes) <= 5, sizes


def test_sigterm_drains_then_aborts_and_exits_0(server):
    """Last test of the module: it stops the server."""
    # 16,000 tokens: 2,000 ended within the 2 s drain on an idle Zen 4 ("length", not "abort")
    body = {"prompt": "long", "max_tokens": 16000, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", server.base_url + "/completions", json=body, headers=server.headers(), timeout=60
    ) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        server.terminate()
        time.sleep(0.3)
        assert httpx.get(server.url + "/health").status_code == 503
        refused = httpx.post(
            server.base_url + "/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers=server.headers(),
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    import json

    last = json.loads(rest[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(timeout=60) == 0, server.log()


def _children(pid: int) -> list[int]:
    import pathlib

    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        out += [int(c) for c in children]
    return out


def test_dead_engine_answers_503(tiny_model_factory, tmp_path):
    """A worker killed mid-stream: the stream ends with an error event, /health and new
    requests answer 503 with the error shape, and the server then exits with code 1 (within
    its grace period, a SIGTERM stops it with the same code; tests/fault has the timing)."""
    import json
    import os
    import signal

    model = tiny_model_factory("llama")
    srv = ServerProcess(
        [model, "--max-model-len", "1024", "--kv-cache-memory", "16MiB"], tmp_path / "s.log"
    ).start()
    try:
        workers = [
            p
            for p in _children(srv.proc.pid)
            if b"worker_main" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert workers, "expected a model-worker subprocess"
        body = {"prompt": "x", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            os.kill(workers[0], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        deadline = time.monotonic() + 15
        while httpx.get(srv.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = httpx.post(srv.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        code = srv.stop()
    assert code == 1, srv.log()


def test_a_port_in_use_is_reported_before_the_engine_starts(tiny_model_factory):
    """The server binds its address before the engine starts (the engine's own processes and
    connections take ports while it loads): a port someone else holds ends ``trillm serve`` at
    once with exit code 1 and a message naming the address, and no engine is started."""
    model = tiny_model_factory("llama")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "trillm",
                "serve",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-model-len",
                "256",
                "--kv-cache-memory",
                "16MiB",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert f"cannot serve on 127.0.0.1:{port}" in log
    assert "engine ready" not in log and "Traceback" not in log
