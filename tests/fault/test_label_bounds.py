"""No /metrics label value comes from the client unbounded, against a real ``trillm serve``.

Each distinct label value is a new series kept for the server's life and sent in every scrape:
before the bound, 1,000 requests with distinct 4,000-character HTTP methods grew /metrics from
63 KB to 28.6 MB. HTTP methods outside HTTP's own are ``other``, paths no route serves are
``none`` (a route with a variable is its template), and a model name the server does not serve
is refused before it reaches a series.
"""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess

pytestmark = pytest.mark.timeout(180)

MODEL = "trillm-default"
ATTACKS = 100  # requests of each kind: each one a new series before the bound
# What a few new, bounded series (``other``, ``none``, 4xx) add to the scrape; one series per
# attack request would add more than 100 times this.
GROWTH_BOUND = 8_000  # measured: 1-2.2 KB
METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("labels") / "server.log"
    srv = ServerProcess(["--runner", "trillm.worker.fake_runner:FakeModelRunner"], log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def raw_request(srv: ServerProcess, method: str, target: str) -> int:
    """The status of one request sent as given (no client normalises it), then closed."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        received = b""
        while data := sock.recv(65536):
            received += data
    return int(received.split(b" ", 2)[1])


def scrape(srv: ServerProcess) -> str:
    return httpx.get(srv.url + "/metrics", timeout=60).text


def label_values(text: str, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if label in sample.labels
    }


def normal_traffic(srv: ServerProcess) -> str:
    """A few ordinary requests (every series they make exists), then the scrape after them."""
    for _ in range(2):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(srv.base_url + "/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(srv.base_url + "/models", timeout=60).status_code == 200
    scrape(srv)  # the /metrics series themselves
    return scrape(srv)


def test_unknown_methods_share_one_label(server):
    before = normal_traffic(server)
    for i in range(ATTACKS):
        long_method = f"M{i:05d}" + "X" * 3994
        assert raw_request(server, long_method, "/nope") == 404
        assert raw_request(server, long_method, "/v1/completions") == 405
        assert raw_request(server, f"get{i}", "/health") == 405
    after = scrape(server)
    assert len(after) - len(before) < GROWTH_BOUND, f"/metrics grew {len(before)} -> {len(after)}"
    assert label_values(after, "method") <= METHODS | {"other"}
    assert "other" in label_values(after, "method")
    longest = max(
        len(v)
        for f in text_string_to_metric_families(after)
        for s in f.samples
        for v in s.labels.values()
    )
    assert longest < 200, "a label value longer than any the server names"


def test_unknown_paths_share_one_handler_label(server):
    before = normal_traffic(server)
    for i in range(ATTACKS):
        assert raw_request(server, "GET", f"/nope/{i}/" + "a" * 2000) == 404
        assert raw_request(server, "GET", f"/v1/models/{i}?q={'b' * 500}") == 404
        assert raw_request(server, "POST", f"/v1/completions%2F{i}%00%ff") == 404
        assert raw_request(server, "GET", f"/v1/responses/resp_{i}{'c' * 1000}") == 404
    after = scrape(server)
    assert len(after) - len(before) < GROWTH_BOUND, f"/metrics grew {len(before)} -> {len(after)}"
    handlers = label_values(after, "handler")
    # A route with a variable is named by its template, as vLLM's instrumentator names it.
    assert "/v1/responses/{response_id}" in handlers
    assert "none" in handlers
    assert all(h == "none" or h.startswith("/") and len(h) < 64 for h in handlers), handlers


def test_unknown_model_names_add_no_series(server):
    before = normal_traffic(server)
    for i in range(ATTACKS):
        name = f"no-such-model-{i}-" + "m" * 500
        completion = {"model": name, "prompt": "hi", "max_tokens": 2}
        chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(server.base_url + "/completions", json=completion).status_code == 404
        assert httpx.post(server.base_url + "/chat/completions", json=chat).status_code == 404
    after = scrape(server)
    assert len(after) - len(before) < GROWTH_BOUND, f"/metrics grew {len(before)} -> {len(after)}"
    assert label_values(after, "model_name") == {MODEL}
