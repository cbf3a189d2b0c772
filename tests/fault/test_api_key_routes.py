"""The API key on every route of a real ``trillm serve``, and where the key comes from.

With a key in force only ``/health``, ``/ping``, ``/version`` and ``/metrics`` answer without it;
every other path, served or not (``/invocations``, ``/tokenize``, ``/pooling``, vLLM's
``/v2/rerank``, a route this server does not have), is a 401. The table of routes below is
checked against the routes the app itself mounts (every optional one on: the development
routes, runtime LoRA updates, ``/tokenizer_info``), so a new route cannot escape it.
``VLLM_API_KEY`` is read as vLLM reads it, ``--api-key`` wins over it, and the start-up log
says which is in force without the key itself.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import trio
from server_harness import ServerProcess

from trillm import envs
from trillm.entrypoints.openai.http.app import build_app
from trillm.entrypoints.openai.http.auth import API_KEY_ENV, KEYLESS_PATHS, ApiKeys

FAKE = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]
KEY, SECOND_KEY = "route-key-7c1e", "second-key-90aa"
COMPLETION = {"prompt": "hi", "max_tokens": 2}
# (method, path, body): every route that runs the model or tells about the server's state,
# and paths vLLM guards by prefix that this server does not serve.
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "hi"}]]}),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/embeddings", {"input": "hi"}),
    ("POST", "/invocations", COMPLETION),
    ("POST", "/pooling", {"input": "hi"}),
    ("POST", "/classify", {"input": "hi"}),
    ("POST", "/score", {"text_1": "a", "text_2": "b"}),
    ("POST", "/v1/score", {"text_1": "a", "text_2": "b"}),
    ("POST", "/rerank", {"query": "a", "documents": ["b"]}),
    ("POST", "/v1/rerank", {"query": "a", "documents": ["b"]}),
    ("POST", "/v2/rerank", {"query": "a", "documents": ["b"]}),
    ("POST", "/inference/v1/generate", COMPLETION),
    ("POST", "/cohere/v2/rerank", {"query": "a", "documents": ["b"]}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/tokenizer_info", None),
    ("POST", "/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/load", None),
    ("GET", "/openapi.json", None),
    ("GET", "/v1/responses/resp_1", None),
    ("POST", "/v1/responses/resp_1/cancel", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "a"}),
    ("POST", "/reset_prefix_cache", None),
    # The development routes (VLLM_SERVER_DEV_MODE=1; absent from this module's server).
    ("POST", "/sleep", None),
    ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("POST", "/collective_rpc", {"method": "noop"}),
    ("GET", "/server_info", None),
    ("POST", "/abort_requests", None),
    ("GET", "/nope", None),
    ("GET", "/health/", None),
    ("GET", "/metrics/x", None),
]
KEYLESS = [
    ("GET", "/health"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("GET", "/version"),
    ("GET", "/metrics"),
]


def every_route_state(monkeypatch) -> SimpleNamespace:
    """A stub server state under which ``build_app`` mounts each optional route (the
    development routes, runtime LoRA updates, ``/tokenizer_info``); the routes would fail on
    it, so only a request the gate refuses may reach them."""
    monkeypatch.setenv(envs.SERVER_DEV_MODE.name, "1")
    return SimpleNamespace(
        loras=SimpleNamespace(allow_updates=True), enable_tokenizer_info_endpoint=True
    )


def app_routes(monkeypatch) -> set[tuple[str, str]]:
    """(method, path) of every route ``build_app`` mounts, each optional route on; a path
    parameter as the table spells it."""
    app = build_app(every_route_state(monkeypatch))  # type: ignore[arg-type]
    routes = set()
    for rule in app.url_map.iter_rules():
        path = rule.rule.replace("<response_id>", "resp_1")
        routes |= {(method, path) for method in rule.methods or () if method != "HEAD"}
    return routes


def test_the_table_holds_every_route_of_the_app(monkeypatch):
    routes = app_routes(monkeypatch)
    assert len(routes) > 30, routes  # the enumeration sees the routes
    listed = {(method, path) for method, path, _ in PROTECTED} | set(KEYLESS)
    assert routes - listed == set(), "routes missing from PROTECTED or KEYLESS"
    assert {path for _, path in KEYLESS} == KEYLESS_PATHS


def test_the_gate_guards_every_route_of_the_app(monkeypatch):
    """In the app itself, every optional route on: no key, a wrong key: 401 before the
    route runs (its state is a stub the routes would fail on)."""
    routes = sorted(app_routes(monkeypatch))
    state = every_route_state(monkeypatch)
    client = build_app(state, ApiKeys((KEY,), "--api-key")).test_client()  # type: ignore[arg-type]

    async def statuses(headers: dict[str, str]) -> dict[tuple[str, str], int]:
        out = {}
        for method, path in routes:
            if path not in KEYLESS_PATHS:
                response = await client.open(path, method=method, headers=headers, json={})
                out[method, path] = response.status_code
        return out

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        answers = trio.run(statuses, headers)
        assert len(answers) == len(routes) - len(KEYLESS), answers
        assert set(answers.values()) == {401}, (headers, answers)


def send(srv: ServerProcess, method: str, path: str, body: dict | None, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, srv.url + path, json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log: Path = tmp_path_factory.mktemp("api-key-routes") / "server.log"
    srv = ServerProcess([*FAKE, "--api-key", KEY, SECOND_KEY], log).start()
    srv.api_key = KEY
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_every_route_but_the_probes_needs_the_key(server, method, path, body):
    refused = send(server, method, path, body, None)
    assert refused.status_code == 401, (path, refused.status_code, refused.text[:300])
    assert refused.json()["error"]["message"] == "Invalid or missing API key."
    assert send(server, method, path, body, "wrong").status_code == 401
    # The control: with the key the gate lets it through (served, or refused for what it is).
    admitted = send(server, method, path, body, KEY)
    assert admitted.status_code != 401, (path, admitted.text[:300])


def test_the_key_opens_what_runs_the_model(server):
    for key in (KEY, SECOND_KEY):  # any one of the keys given
        out = send(server, "POST", "/invocations", COMPLETION, key)
        assert out.status_code == 200 and out.json()["choices"][0]["text"], out.text
        tokens = send(server, "POST", "/tokenize", {"prompt": "hi"}, key)
        assert tokens.status_code == 200 and tokens.json()["tokens"], tokens.text
        assert send(server, "GET", "/v1/models", None, key).status_code == 200


@pytest.mark.parametrize(("method", "path"), KEYLESS)
def test_probes_stay_open(server, method, path):
    assert send(server, method, path, None, None).status_code == 200


def test_start_up_names_the_setting_never_the_key(server):
    log = server.log()
    assert "API key: required on every route but /health, /metrics, /ping, /version " in log
    assert "(2 keys from --api-key)" in log
    assert KEY not in log and SECOND_KEY not in log


def _start_with_env(tmp_path, monkeypatch, env_key: str, args: list[str]) -> ServerProcess:
    monkeypatch.setenv(API_KEY_ENV, env_key)
    return ServerProcess([*FAKE, *args], tmp_path / "server.log").start()


def test_vllm_api_key_is_read(tmp_path, monkeypatch):
    srv = _start_with_env(tmp_path, monkeypatch, "env-key-31f", [])
    try:
        invocations = next(route for route in PROTECTED if route[1] == "/invocations")
        for method, path, body in (PROTECTED[0], PROTECTED[1], invocations):
            assert send(srv, method, path, body, None).status_code == 401, path
            assert send(srv, method, path, body, "env-key-31f").status_code == 200, path
        assert send(srv, "GET", "/health", None, None).status_code == 200
        assert f"(1 key from {API_KEY_ENV})" in srv.log()
        assert "env-key-31f" not in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_the_flag_wins_over_vllm_api_key(tmp_path, monkeypatch):
    srv = _start_with_env(tmp_path, monkeypatch, "env-key-31f", ["--api-key", "flag-key-8d2"])
    try:
        assert send(srv, "GET", "/v1/models", None, "env-key-31f").status_code == 401
        assert send(srv, "GET", "/v1/models", None, "flag-key-8d2").status_code == 200
        assert "(1 key from --api-key)" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_resolution_as_vllm(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "e")
    assert ApiKeys.resolve(None) == ApiKeys(("e",), API_KEY_ENV)
    assert ApiKeys.resolve(["a", "b"]) == ApiKeys(("a", "b"), "--api-key")
    assert ApiKeys.resolve([""]) == ApiKeys(("e",), API_KEY_ENV)  # empty keys are none
    monkeypatch.setenv(API_KEY_ENV, "")
    assert ApiKeys.resolve(None) == ApiKeys()
    monkeypatch.delenv(API_KEY_ENV)
    assert ApiKeys.resolve(None).describe().endswith("every route is open.")
    keys = ApiKeys(("a", "b"), "--api-key")
    assert keys.admits(b"Bearer b") and not keys.admits(b"Bearer ab")
    assert not keys.admits(b"bearer a") and not keys.admits(b"Bearer a ")
    assert not ApiKeys().needs_key("/v1/models") and keys.needs_key("/v1/models")
    assert not keys.needs_key("/health") and keys.needs_key("/health/")
