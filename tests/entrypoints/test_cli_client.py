"""``trillm complete`` / ``trillm chat`` run in this process against a stub server: the
command closes its connections when it returns, answered or refused (none is left for the
garbage collector)."""

from __future__ import annotations

import gc
import http.server
import json
import threading
import warnings
from collections.abc import Iterator

import pytest

from trillm.entrypoints.cli.main import main

# One chunk that both commands read: ``complete`` its text, ``chat`` its delta.
CHUNK = {"choices": [{"text": "Hello", "delta": {"content": "Hello"}}]}
KEY = "sesame"
EVENTS = b"data: " + json.dumps(CHUNK).encode() + b"\n\ndata: [DONE]\n\n"


class _Stub(http.server.BaseHTTPRequestHandler):
    """/models lists one model; a completion streams one piece; a request without the key is
    refused (401). HTTP/1.1, so the client keeps the connection in its pool after an answer it
    read to the end."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.headers["Authorization"] != f"Bearer {KEY}":
            error = {"error": {"message": "wrong key", "type": "Unauthorized"}}
            self._answer(json.dumps(error).encode(), "application/json", 401)
            return
        self._answer(json.dumps({"data": [{"id": "stub"}]}).encode(), "application/json")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(EVENTS, "text/event-stream")

    def _answer(self, body: bytes, kind: str, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize(
    ("command", "key", "exit_code", "shown"),
    [
        ("complete", KEY, 0, "Using model: stub\nHello\n"),
        ("chat", KEY, 0, "Using model: stub\nHello\n"),
        ("complete", "wrong", 1, "trillm complete: the server answered 401: wrong key"),
    ],
)
def test_client_command_closes_its_connections(stub_url, command, key, exit_code, shown, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        code = main([command, "--url", stub_url, "--api-key", key, "-q", "Hi"])
        gc.collect()  # an unclosed pool's sockets would warn here, when collected
    out, err = capsys.readouterr()
    assert code == exit_code and shown in out + err, (out, err)
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
