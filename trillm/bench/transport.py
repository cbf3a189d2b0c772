"""HTTP transports for the load generator: ``post_sse`` streams one POST's SSE ``data:`` lines.

``H11Transport`` (default) is a small HTTP/1.1 client on Trio sockets and ``h11``: a keep-alive
pool per host with O(1) checkout, so a burst of thousands of streams costs the client little.
``HttpxTransport`` is the same interface on ``httpx.AsyncClient`` (``--http-client httpx``),
kept to compare against and for servers that need what httpx adds (TLS, proxies).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import orjson
import trio

CONNECT_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 6 * 60 * 60  # as vLLM: a benchmark request may legitimately be slow
READ_SIZE = 65536

OnData = Callable[[bytes], bool]  # one SSE data payload -> True once the stream is done


class TransportError(Exception):
    """The request could not be sent or the response could not be read."""


def auth_headers() -> list[tuple[str, str]]:
    """``OPENAI_API_KEY``, when set, goes as a bearer token (as vLLM's harness does)."""
    key = os.environ.get("OPENAI_API_KEY")
    return [("Authorization", f"Bearer {key}")] if key else []


class _LineSplitter:
    """Bytes in, complete lines out (\\n or \\r\\n endings)."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        lines = (self._tail + data).split(b"\n")
        self._tail = lines.pop()
        return [line.rstrip(b"\r") for line in lines]


class _ChunkedDecoder:
    """A chunked HTTP/1.1 body (RFC 9112 7.1), bytes in, body pieces out: the streaming hot
    path of the client, a few slices per chunk where h11 builds an event per chunk."""

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # data bytes left in the current chunk
        self._crlf = False  # the CRLF after a chunk's data is due
        self._trailers = False  # after the last (zero-size) chunk
        self.complete = False
        self.excess = b""  # bytes after the body (a pipelined response: never reused then)

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        pos, end, out = 0, len(buf), []
        while pos < end and not self.complete:
            if self._left:
                take = min(self._left, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                self._crlf = not self._left
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            if self._crlf:
                if eol != pos:
                    raise TransportError("RemoteProtocolError: bad chunk framing")
                self._crlf = False
            elif self._trailers:
                self.complete = eol == pos  # the empty line ends the trailers
            else:
                try:
                    size = int(buf[pos:eol].split(b";", 1)[0], 16)
                except ValueError:
                    raise TransportError("RemoteProtocolError: bad chunk size") from None
                self._left = size
                self._trailers = size == 0
            pos = eol + 2
        if self.complete:
            self.excess, self._buf = buf[pos:], b""
        else:
            self._buf = buf[pos:]
        return out


def _is_chunked(response: h11.Response) -> bool:
    return any(
        name == b"transfer-encoding" and value.lower() == b"chunked"
        for name, value in response.headers
    )


def _keeps_alive(response: h11.Response) -> bool:
    return not any(
        name == b"connection" and b"close" in value.lower() for name, value in response.headers
    )


def feed_sse_lines(lines: list[bytes], on_data: OnData) -> bool:
    """Hands every ``data:`` payload to on_data; True once it reports the end."""
    for line in lines:
        if line.startswith(b"data:") and on_data(line[5:].strip()):
            return True
    return False


class _NoResponse(Exception):
    """The connection closed before a response began: safe to retry on a fresh one."""


class _Connection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.reuse = False  # set when the body was read past h11 and the exchange ended well

    async def send(self, *events: Any) -> None:
        await self.stream.send_all(b"".join(self.h11.send(e) or b"" for e in events))

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.receive_some(READ_SIZE))

    def reusable(self) -> bool:
        if self.reuse:
            return True
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    def recycle(self) -> None:
        if self.reuse:
            self.h11 = h11.Connection(h11.CLIENT)  # the body was read past this one
            self.reuse = False
        else:
            self.h11.start_next_cycle()

    async def stream_sse(self, response: h11.Response, on_data: OnData) -> None:
        """A 200 chunked SSE body, read from the socket without h11 (it has parsed the head;
        what it buffered beyond is the body's start)."""
        decoder, lines, done = _ChunkedDecoder(), _LineSplitter(), False
        data, closed = self.h11.trailing_data
        while True:
            for piece in decoder.feed(bytes(data)):
                if not done:
                    done = feed_sse_lines(lines.feed(piece), on_data)
            if decoder.complete:
                break
            if closed:
                raise TransportError("RemoteProtocolError: connection closed mid-body")
            data = await self.stream.receive_some(READ_SIZE)
            closed = not data
        self.reuse = not decoder.excess and _keeps_alive(response)


class H11Transport:
    """Keep-alive HTTP/1.1 on Trio; one connection per in-flight request, no cap."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def _connect(self, host: str, port: int) -> _Connection:
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError) as e:
            raise TransportError(f"ConnectError: cannot connect to {host}:{port}: {e}") from None
        return _Connection(stream)

    async def _exchange(
        self, conn: _Connection, request: list[Any], on_data: OnData
    ) -> tuple[int, bytes]:
        try:
            await conn.send(*request)
            response = await conn.next_event()
        except (trio.BrokenResourceError, h11.RemoteProtocolError, OSError) as e:
            raise _NoResponse(f"{type(e).__name__}: {e}") from None
        while isinstance(response, h11.InformationalResponse):
            response = await conn.next_event()
        if not isinstance(response, h11.Response):
            raise _NoResponse(type(response).__name__)
        if response.status_code == 200 and _is_chunked(response):
            await conn.stream_sse(response, on_data)
            return 200, b""
        body, lines, done = [], _LineSplitter(), False
        while True:
            event = await conn.next_event()
            if isinstance(event, h11.Data):
                if response.status_code != 200:
                    body.append(bytes(event.data))
                elif not done:
                    done = feed_sse_lines(lines.feed(bytes(event.data)), on_data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return response.status_code, b"".join(body)

    async def post_sse(
        self, url: str, body: bytes, on_data: OnData, extra: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """POST ``body`` (JSON); SSE data payloads go to ``on_data``. -> (status, error body).
        ``extra``: more headers (--header, x-request-id)."""
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise TransportError(
                f"Only http:// URLs are supported here ({url}); use --http-client httpx."
            )
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = [
            ("Host", parts.netloc),
            ("Content-Type", "application/json"),
            ("Accept", "text/event-stream"),
            ("Content-Length", str(len(body))),
            *auth_headers(),
            *(extra or {}).items(),
        ]
        request = [
            h11.Request(method="POST", target=target, headers=headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ]
        idle = self._idle.setdefault(key, [])
        if idle:  # a kept-alive connection the server may have closed meanwhile
            try:
                return await self._request(idle.pop(), request, on_data, idle)
            except _NoResponse:
                pass
        try:
            return await self._request(await self._connect(*key), request, on_data, idle)
        except _NoResponse as e:
            raise TransportError(
                f"RemoteProtocolError: connection closed without a response ({e})"
            ) from None

    async def _request(
        self, conn: _Connection, request: list[Any], on_data: OnData, idle: list[_Connection]
    ) -> tuple[int, bytes]:
        try:
            status, error_body = await self._exchange(conn, request, on_data)
        except _NoResponse:
            await conn.stream.aclose()
            raise
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            h11.ProtocolError,
            OSError,
        ) as e:
            await conn.stream.aclose()
            raise TransportError(f"{type(e).__name__}: {e}") from None
        except BaseException:
            await trio.aclose_forcefully(conn.stream)  # cancelled mid-stream: drop the socket
            raise
        if conn.reusable():
            conn.recycle()
            idle.append(conn)
        else:
            await conn.stream.aclose()
        return status, error_body

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                await conn.stream.aclose()
        self._idle.clear()


class HttpxTransport:
    """The same interface on httpx (pooled, no connection cap)."""

    def __init__(self, verify: bool = True) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        # NOTE: trust_env=False: a benchmark talks to the server directly, never via a proxy.
        self.client = httpx.AsyncClient(
            limits=limits,
            timeout=timeout,
            headers=dict(auth_headers()),
            trust_env=False,
            verify=verify,  # --insecure: False
        )

    async def post_sse(
        self, url: str, body: bytes, on_data: OnData, extra: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        headers.update(extra or {})
        try:
            async with self.client.stream("POST", url, content=body, headers=headers) as response:
                if response.status_code != 200:
                    return response.status_code, await response.aread()
                lines, done = _LineSplitter(), False
                # NOTE: read to the body's end, as H11Transport does: left at [DONE], httpx's
                # nested async generators would be collected unfinished (a ResourceWarning
                # each) and the connection closed instead of kept alive.
                async for data in response.aiter_bytes():
                    if not done:
                        done = feed_sse_lines(lines.feed(data), on_data)
                return 200, b""
        except httpx.HTTPError as e:
            raise TransportError(f"{type(e).__name__}: {e}") from None

    async def aclose(self) -> None:
        await self.client.aclose()


Transport = H11Transport | HttpxTransport


def make_transport(kind: str = "h11", verify: bool = True) -> Transport:
    if kind == "h11":
        if not verify:
            raise ValueError("--insecure (TLS without verification) needs --http-client httpx.")
        return H11Transport()
    if kind == "httpx":
        return HttpxTransport(verify)
    raise ValueError(f"Unknown HTTP client {kind!r}; choose h11 or httpx.")


async def get_json(
    url: str, headers: dict[str, str] | None = None, verify: bool = True
) -> tuple[int, Any]:
    """A plain GET (setup calls); raises TransportError when the server cannot be reached."""
    try:
        async with httpx.AsyncClient(
            trust_env=False,
            timeout=CONNECT_TIMEOUT_S,
            headers={**dict(auth_headers()), **(headers or {})},
            verify=verify,
        ) as c:
            response = await c.get(url)
    except httpx.HTTPError as e:
        raise TransportError(f"{type(e).__name__}: {e}") from None
    try:
        return response.status_code, response.json()
    except (ValueError, orjson.JSONDecodeError):
        return response.status_code, None
