"""The API key on a real ``trillm serve --api-key``: no path spelling, encoding,
request-target form, method, ``Host`` or proxy header, nor HTTP/2, reaches a /v1 route without
the key; the answers never echo the key or the server's internals; and the check itself is
constant-time (``hmac.compare_digest``).

Requests go out on raw sockets, byte for byte as written here (an HTTP client library would
normalize the very spellings under test).
"""

from __future__ import annotations

import inspect
import json
import socket
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest
from server_harness import ServerProcess

KEY = "sekrit-KEY-4f1d"
GOOD_AUTH = f"Authorization: Bearer {KEY}\r\n"
BODY = json.dumps(
    {"prompt": "hi", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
).encode()
# A served /v1 answer contains the model's name (models, completions, chat alike).
SERVED_MARKER = b"trillm-default"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log: Path = tmp_path_factory.mktemp("api-key") / "server.log"
    srv = ServerProcess(
        ["--runner", "trillm.worker.fake_runner:FakeModelRunner"], log, api_key=KEY
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def raw(srv: ServerProcess, request_line: str, headers: str | None = None, body: bytes = b""):
    """Send one request exactly as given; return (status, headers, body)."""
    if headers is None:
        headers = "Host: 127.0.0.1\r\n"
    if body:
        headers += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    data = f"{request_line}\r\n{headers}Connection: close\r\n\r\n".encode("latin-1") + body
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, payload = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, head, payload


def assert_refused(status: int, head: bytes, payload: bytes) -> None:
    # 401 (the gate), 404 (no such route: nothing served), 400 (malformed request)
    assert status in (400, 401, 404), (status, payload[:300])
    assert SERVED_MARKER not in payload, payload[:300]
    assert KEY.encode() not in head + payload
    assert b"Traceback" not in payload and b'File "' not in payload


# Spellings of a protected route. Each must be refused without the key.
GET_TARGETS = [
    "/v1/models",
    "/V1/models",
    "/v1/MODELS",
    "//v1/models",
    "///v1/models",
    "/v1//models",
    "/v1/models/",
    "/v1/models?",
    "/v1/models?x=/health",
    "/v1/models#",
    "/v1/models;x",
    "/v1/./models",
    "/./v1/models",
    "/v1/../v1/models",
    "/health/../v1/models",
    "/v1/%2e%2e/v1/models",
    "/%2e/v1/models",
    "/v1%2Fmodels",
    "/v1%2fmodels",
    "%2Fv1/models",
    "/%76%31/models",
    "/v1/%6dodels",
    "//%76%31//models",
    "/v1\\models",
    "/v1",
    "/v1/",
    "http://127.0.0.1/v1/models",
    "http://evil.example/v1/models",
    "http://evil.example//v1/models",
    "http://127.0.0.1/health/../v1/models",
]


@pytest.mark.parametrize("target", GET_TARGETS)
def test_get_spellings_need_the_key(server, target):
    assert_refused(*raw(server, f"GET {target} HTTP/1.1"))


POST_TARGETS = [
    "/v1/completions",
    "/V1/completions",
    "//v1/completions",
    "/v1//completions",
    "/v1/%63ompletions",
    "/v1%2Fcompletions",
    "/v1/chat/completions",
    "/v1/chat//completions",
    "/v1/chat%2Fcompletions",
    "//v1//chat/completions",
    "/v1/../v1/chat/completions",
    "http://evil.example/v1/chat/completions",
]


@pytest.mark.parametrize("target", POST_TARGETS)
def test_post_spellings_need_the_key(server, target):
    assert_refused(*raw(server, f"POST {target} HTTP/1.1", body=BODY))


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS", "PUT", "DELETE", "PATCH", "TRACE"])
def test_other_methods_need_the_key(server, method):
    status, head, payload = raw(server, f"{method} /v1/models HTTP/1.1")
    assert status in (401, 405), (status, payload)
    assert_refused(401 if status == 405 else status, head, payload)


@pytest.mark.parametrize(
    "headers",
    [
        "Host: evil.example\r\n",
        "Host: localhost:1\r\n",
        "Host: 127.0.0.1\r\nHost: other\r\n",
        "",  # no Host at all (HTTP/1.1 requires one)
        "Host: 127.0.0.1\r\nX-Forwarded-For: 127.0.0.1\r\nX-Real-IP: 127.0.0.1\r\n",
        "Host: 127.0.0.1\r\nX-Original-URL: /health\r\nX-Rewrite-URL: /health\r\n",
        "Host: 127.0.0.1\r\nX-Forwarded-Host: 127.0.0.1\r\nX-Forwarded-Proto: https\r\n",
    ],
)
def test_host_and_proxy_headers_do_not_bypass(server, headers):
    assert_refused(*raw(server, "GET /v1/models HTTP/1.1", headers))


@pytest.mark.parametrize(
    "auth",
    [
        "Authorization: bearer {key}\r\n",
        "Authorization: Bearer {lower}\r\n",
        "Authorization: Basic {key}\r\n",
        "Authorization: {key}\r\n",
        "Authorization: Bearer\r\n",
        "Authorization: Bearer {key}x\r\n",
        "Authorization: Bearer {prefix}\r\n",
        "Authorization: Bearer  {key}\r\n",
        "Authorization: Bearer wrong\r\nAuthorization: Bearer {key}\r\n",
        "Authorization: Bearer {key}\x00\r\n",
        "Authorization: Bearer {key}\xe9\r\n",
        "X-API-Key: {key}\r\n",
        "Proxy-Authorization: Bearer {key}\r\n",
        "Cookie: Authorization=Bearer {key}\r\n",
    ],
)
def test_wrong_credentials_are_refused_without_echo(server, auth):
    line = auth.format(key=KEY, lower=KEY.lower(), prefix=KEY[:-1])
    status, head, payload = raw(server, "GET /v1/models HTTP/1.1", "Host: 127.0.0.1\r\n" + line)
    assert_refused(status, head, payload)
    if status == 401:
        assert json.loads(payload)["error"]["message"] == "Invalid or missing API key."


def test_http10_needs_the_key(server):
    assert_refused(*raw(server, "GET /v1/models HTTP/1.0", ""))


def test_the_key_opens_every_protected_route(server):
    """The control: with the key the same raw requests are served (so the refusals above are
    the gate's doing, and this test file can fail)."""
    auth = "Host: 127.0.0.1\r\n" + GOOD_AUTH
    status, _, payload = raw(server, "GET /v1/models HTTP/1.1", auth)
    assert status == 200 and SERVED_MARKER in payload, payload
    for route in ("/v1/completions", "/v1/chat/completions"):
        status, _, payload = raw(server, f"POST {route} HTTP/1.1", auth, BODY)
        assert status == 200 and SERVED_MARKER in payload, (route, payload)
    # An encoded spelling that routes to the same handler is gated, then served with the key.
    status, _, payload = raw(server, "GET /v1%2Fmodels HTTP/1.1", auth)
    assert status == 200 and SERVED_MARKER in payload, payload


def test_http2_prior_knowledge_needs_the_key(server):
    """h2c with prior knowledge (hypercorn speaks it on the plain port; h2 comes with it):
    the same gate."""

    def get(path: str, extra: list[tuple[str, str]]) -> tuple[int, bytes]:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        headers = [
            (":method", "GET"),
            (":scheme", "http"),
            (":authority", "127.0.0.1"),
            (":path", path),
            *extra,
        ]
        conn.send_headers(1, headers, end_stream=True)
        status, body = 0, b""
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(conn.data_to_send())
            done = False
            while not done:
                data = s.recv(65536)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = int(dict(event.headers)[b":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        body += event.data
                        conn.acknowledge_received_data(len(event.data), event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                        done = True
                s.sendall(conn.data_to_send())
        return status, body

    for path in ("/v1/models", "//v1/models", "/v1%2Fmodels", "/v1/../v1/models"):
        status, body = get(path, [])
        assert_refused(status, b"", body)
    status, body = get("/v1/models", [("authorization", f"Bearer {KEY}")])
    assert status == 200 and SERVED_MARKER in body, body


def test_the_check_is_constant_time():
    """A byte-by-byte ``==`` would leak the key's prefix through timing; timing itself is too
    noisy to test on a shared machine, so check what the gate compares with."""
    from trillm.entrypoints.openai.http import app, auth

    assert "api_keys.admits(" in inspect.getsource(app._install_gate)
    source = inspect.getsource(auth.ApiKeys.admits)
    assert "hmac.compare_digest(" in source
    assert "==" not in source and "break" not in source and "return True" not in source
