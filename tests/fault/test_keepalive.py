"""HTTP/1.1 keep-alive against a real ``trillm serve``, over raw sockets (issue 11, defect 3).

quart-trio cancels hypercorn's connection bookkeeping (see trillm/entrypoints/openai/
http_guard.py): without the guard the keep-alive timeout stops applying after the first
request, ``Connection: close`` and HTTP/1.0 leave the socket open, and an error answered
before the request body arrived leaves the connection dead for the next request.
"""

from __future__ import annotations

import socket
import time

import pytest
from server_harness import ServerProcess

KEY = "sk-keepalive"
KEEP_ALIVE_S = 1.0
REPEATS = 10  # the early-answer failure is a race: one try proves little

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("keepalive") / "server.log"
    srv = ServerProcess(
        [
            "--runner",
            "trillm.worker.fake_runner:FakeModelRunner",
            "--timeout-keep-alive",
            str(KEEP_ALIVE_S),
        ],
        log,
        api_key=KEY,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


# ---------------------------------------------------------------- a tiny HTTP/1.1 client


def connect(srv: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Reader:
    """Reads whole responses (Content-Length or chunked) off one connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    def _take_until(self, mark: bytes) -> bytes:
        while mark not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(mark)
        return head

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
        self.sock.settimeout(timeout)
        head = self._take_until(b"\r\n\r\n").decode("latin1").split("\r\n")
        status = int(head[0].split(" ")[1])
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int(self._take_until(b"\r\n").split(b";")[0], 16):
                body += self._take(size)
                self._take(2)
            self._take_until(b"\r\n")
        else:
            body = self._take(int(headers.get("content-length", "0")))
        return status, headers, body


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True once the server ends the connection (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def models_request() -> bytes:
    return f"GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()


# ---------------------------------------------------------------- keep-alive timeout


def test_idle_connection_closed_after_keep_alive_timeout(server):
    fresh = connect(server)  # never sends a request
    used = connect(server)
    reader = Reader(used)
    for i in range(2):  # a connection that served requests is still reusable...
        if i:
            time.sleep(KEEP_ALIVE_S / 3)
        used.sendall(models_request())
        assert reader.response()[0] == 200
    last_answer = time.monotonic()
    # ...and both are closed once idle for the keep-alive timeout, not kept open forever.
    assert closed_by_server(used, KEEP_ALIVE_S + 3), "idle after a request: never closed"
    assert time.monotonic() - last_answer >= KEEP_ALIVE_S * 0.8, "closed before the timeout"
    assert closed_by_server(fresh, KEEP_ALIVE_S + 3), "idle from the start: never closed"
    used.close()
    fresh.close()


# ---------------------------------------------------------------- Connection: close, HTTP/1.0


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        b"GET /health HTTP/1.0\r\n\r\n",
        b"POST /tokenize HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 15\r\n\r\n"
        b'{"prompt":"hi"}',
    ],
    ids=["connection-close", "http-1.0", "connection-close-post"],
)
def test_server_closes_when_asked(server, request_bytes):
    for attempt in range(REPEATS):
        sock = connect(server)
        sock.sendall(request_bytes)
        status, _, _ = Reader(sock).response()
        assert status == 200
        # Well inside the keep-alive timeout: the close comes from the request, not idling.
        assert closed_by_server(sock, KEEP_ALIVE_S / 2), f"left open (try {attempt})"
        sock.close()


# ---------------------------------------------------------------- early answers


BODY = b'{"model": "x", "prompt": "hello", "max_tokens": 2}'
EARLY = {
    # name: (request head without Content-Length/end, expected status)
    "401-api-key": (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n",
        401,
    ),
    "405-method": (
        b"PUT /v1/completions HTTP/1.1\r\nHost: t\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\n",
        405,
    ),
    # a body that is not JSON: 400, as OpenAI answers
    "400-content-type": (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: text/plain\r\n",
        400,
    ),
}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("case", list(EARLY))
def test_early_answer_keeps_connection_usable(server, case, chunked):
    """The answer comes before the body (sent in a second write, as httpx and requests do);
    the next request on the same connection must still be answered."""
    head, expected = EARLY[case]
    if chunked:
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    else:
        head += b"Content-Length: %d\r\n\r\n" % len(BODY)
        body = BODY
    sock = connect(server)
    reader = Reader(sock)
    for attempt in range(REPEATS):
        sock.sendall(head)
        status, headers, _ = reader.response()
        assert status == expected, (attempt, headers)
        assert headers.get("connection", "").lower() != "close"
        time.sleep(0.02)
        sock.sendall(body)
        sock.sendall(models_request())
        try:
            status, _, _ = reader.response(timeout=KEEP_ALIVE_S + 3)
        except (TimeoutError, ConnectionError) as exc:
            pytest.fail(f"{case}: try {attempt}: the next request got no answer ({exc!r})")
        assert status == 200
    sock.close()


def test_early_answer_to_a_large_body_closes_the_connection(server):
    """A body too large to drain is not read: the answer says ``Connection: close`` and the
    server closes, instead of leaving a connection that can never be reused."""
    head, _ = EARLY["401-api-key"]
    for attempt in range(REPEATS):
        sock = connect(server)
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % (8 * 1024 * 1024))
        status, headers, _ = Reader(sock).response()
        assert status == 401
        assert headers.get("connection", "").lower() == "close", headers
        assert closed_by_server(sock, KEEP_ALIVE_S / 2), f"left open (try {attempt})"
        sock.close()


# ---------------------------------------------------------------- the flag


def test_timeout_keep_alive_flag_reaches_hypercorn(capsys):
    from trillm.entrypoints.cli.main import build_parser
    from trillm.entrypoints.cli.serve_args import server_options
    from trillm.entrypoints.openai.http.listener import hypercorn_config, reserve_listener

    def config(*flags: str):
        opts = server_options(build_parser().parse_args(["serve", *flags]))
        made = hypercorn_config(opts, reserve_listener("127.0.0.1", 0))
        fd = int(made.bind[0].removeprefix("fd://"))  # the socket hypercorn would own
        socket.socket(fileno=fd).close()
        return made

    assert config().keep_alive_timeout == 5.0  # uvicorn's and vLLM's default
    assert config("--timeout-keep-alive", "2.5").keep_alive_timeout == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--timeout-keep-alive", bad])
        assert "timeout-keep-alive" in capsys.readouterr().err
