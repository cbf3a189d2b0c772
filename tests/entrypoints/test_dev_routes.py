"""vLLM's development routes on a real ``trillm serve``: absent (404) without
``VLLM_SERVER_DEV_MODE=1``, behind the API key (401) with it; /sleep and /wake_up (with tags)
keep greedy completions equal; a completion sent while the server sleeps or is paused waits
and ends after /wake_up or /resume (a 200, never a 5xx); /reset_prefix_cache, /is_paused,
/is_sleeping, /collective_rpc; what the engine refuses is a 400 naming it."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from server_harness import ServerProcess, fake_llama_args, wait_gauges

KEY = "dev-routes-key-51b2"
ROUTES = [
    ("POST", "/sleep?level=1"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/pause?mode=keep"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/collective_rpc"),
]
GREEDY = {"prompt": [5, 17, 300, 41, 9], "max_tokens": 8, "temperature": 0, "logprobs": 1}


def _start(log: Path, args: list[str], dev_mode: bool) -> ServerProcess:
    with pytest.MonkeyPatch.context() as env:
        if dev_mode:
            env.setenv("VLLM_SERVER_DEV_MODE", "1")
        else:
            env.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        return ServerProcess(args, log, api_key=KEY).start()


def _call(srv: ServerProcess, method: str, path: str, key: str | None = KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = kw.pop("json", {"method": "kv_cache_bytes"} if path == "/collective_rpc" else None)
    return httpx.request(method, srv.url + path, headers=headers, json=body, timeout=120, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("llama")
    log = tmp_path_factory.mktemp("dev-routes") / "server.log"
    args = [path, "--max-model-len", "128", "--kv-cache-memory", "16MiB", "--enable-sleep-mode"]
    srv = _start(log, args, dev_mode=True)
    yield srv
    assert srv.stop() == 0, srv.log()


def _greedy(srv: ServerProcess) -> tuple[list[str], list[float]]:
    out = _call(srv, "POST", "/v1/completions", json=GREEDY)
    assert out.status_code == 200, out.text
    logprobs = out.json()["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def _in_background(srv: ServerProcess) -> tuple[threading.Thread, list]:
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(_greedy(srv)), daemon=True)
    thread.start()
    return thread, answers


def test_without_dev_mode_the_routes_do_not_exist(tmp_path_factory, tiny_model_factory):
    log = tmp_path_factory.mktemp("no-dev-mode") / "server.log"
    args = fake_llama_args(tiny_model_factory("llama"), "--enable-sleep-mode")
    srv = _start(log, args, dev_mode=False)
    try:
        for method, path in ROUTES:
            assert _call(srv, method, path).status_code == 404, path
            assert _call(srv, method, path, key=None).status_code == 401, path
    finally:
        assert srv.stop() == 0, srv.log()


def test_dev_routes_need_the_key(server):
    for method, path in ROUTES:
        refused = _call(server, method, path, key=None)
        assert refused.status_code == 401, (path, refused.text)
        assert refused.json()["error"]["message"] == "Invalid or missing API key."


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_greedy_completions(server, level):
    before = _greedy(server)
    assert _call(server, "POST", f"/sleep?level={level}").status_code == 200
    assert _call(server, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    assert _call(server, "POST", "/collective_rpc").json() == {"results": [0]}
    assert _call(server, "POST", "/wake_up?tags=weights").status_code == 200
    assert _call(server, "GET", "/is_sleeping").json() == {"is_sleeping": True}  # KV still
    assert _call(server, "POST", "/wake_up?tags=kv_cache").status_code == 200
    assert _call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    assert _call(server, "POST", "/collective_rpc").json()["results"][0] > 0
    assert _greedy(server) == before


@pytest.mark.parametrize(
    ("hold", "release"), [("/sleep?mode=keep", "/wake_up"), ("/pause?mode=keep", "/resume")]
)
def test_a_completion_sent_meanwhile_waits_and_ends_after(server, hold, release):
    expected = _greedy(server)
    assert _call(server, "POST", hold).status_code == 200
    paused = hold.startswith("/pause")
    assert _call(server, "GET", "/is_paused").json() == {"is_paused": paused}
    thread, answers = _in_background(server)
    wait_gauges(server, (0, 1))  # queued, not running
    assert thread.is_alive() and not answers
    assert _call(server, "POST", release).status_code == 200
    thread.join(60)
    assert answers == [expected]
    assert _call(server, "GET", "/is_paused").json() == {"is_paused": False}


def test_reset_prefix_cache_and_collective_rpc(server):
    assert _call(server, "POST", "/reset_prefix_cache").status_code == 200
    running = _call(server, "POST", "/reset_prefix_cache?reset_running_requests=true")
    assert running.status_code == 200
    results = _call(server, "POST", "/collective_rpc", json={"method": "kv_cache_bytes"}).json()
    assert results["results"][0] == 16 * 2**20


@pytest.mark.parametrize(
    ("method", "path", "body", "words"),
    [
        ("POST", "/sleep?level=3", None, "sleep level=3"),
        ("POST", "/sleep?level=one", None, "level='one'"),
        ("POST", "/pause?mode=nap", None, "mode='nap'"),
        ("POST", "/pause?clear_cache=maybe", None, "clear_cache='maybe'"),
        ("POST", "/wake_up?tags=optimizer", None, "wake_up tag 'optimizer'"),
        ("POST", "/reset_prefix_cache?reset_external=true", None, "'reset_external'"),
        ("POST", "/collective_rpc", {"args": []}, "Missing 'method'"),
        ("POST", "/collective_rpc", {"method": "no_such"}, "no method 'no_such'"),
        ("POST", "/collective_rpc", {"method": "kv_cache_bytes", "args": {}}, "args must"),
        ("POST", "/collective_rpc", {"method": "kv_cache_bytes", "timeout": -1}, "timeout"),
    ],
)
def test_refusals_are_400s_naming_what(server, method, path, body, words):
    refused = _call(server, method, path, json=body)
    assert refused.status_code == 400, refused.text
    assert words in refused.json()["error"]["message"]


def test_sleep_without_enable_sleep_mode_is_refused(tmp_path_factory, tiny_model_factory):
    log = tmp_path_factory.mktemp("dev-no-sleep") / "server.log"
    srv = _start(log, fake_llama_args(tiny_model_factory("llama")), dev_mode=True)
    try:
        refused = _call(srv, "POST", "/sleep")
        assert refused.status_code == 400 and "--enable-sleep-mode" in refused.text
        assert _call(srv, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    finally:
        assert srv.stop() == 0, srv.log()
