"""HTTP/1.1 keep-alive that holds on quart-trio + hypercorn: an ASGI wrapper around the app.

Upstream cause (quart-trio 0.12.0 with hypercorn 0.18.0; no fix released):

``quart_trio.asgi.TrioASGIHTTPConnection`` runs ``handle_messages`` (reads ``receive()``) and
``handle_request`` (calls ``send()``) in one nursery, and whichever ends first cancels that
nursery. Hypercorn delivers ``http.disconnect`` *from inside the app's own last ``send()``*:
``HTTPStream.app_send`` -> ``_send_closed`` -> ``H11Protocol._maybe_recycle`` ->
``_close_stream`` puts ``http.disconnect`` on the app queue and then, still in the app's task,
recycles or closes the connection. ``handle_messages`` wakes on that message and cancels the
nursery, so the cancellation lands in the middle of hypercorn's connection bookkeeping:

- keep-alive: ``Updated(idle=True)`` -> ``TrioSingleTask.restart`` (a lock acquire) is
  cancelled, so the idle timer is never restarted: after the first request a connection never
  times out (``keep_alive_timeout`` no longer applies; idle sockets pile up);
- ``Connection: close`` / HTTP/1.0 and an answer given before the body was read (h11 not
  reusable): ``TCPServer._close`` (``send_eof``, a checkpoint) is cancelled before
  ``aclose()``, so the socket stays open; after an early error the body that arrives later
  leaves h11 ``PAUSED`` with nobody to call ``start_next_cycle``: the next request on that
  connection is never answered.

A raw ASGI app does not cancel its own ``send()`` and is not affected. Upstream: hypercorn
issue #330 "Connection:close ignored?" (open, a quart-trio user, no diagnosis) shows the
symptom; hypercorn #106 (trio cancellation skips the socket shutdown) is the same family. No
quart-trio issue names this cause.

The fix here, without patching either library:

1. the app's final ``http.response.body`` is sent under a shield, so hypercorn's recycle/close
   runs to completion (hypercorn already shields its socket writes, so this adds no wait a
   client can stretch);
2. an answer given before the request body arrived (401 api key, 405, 415, ...) waits, before
   that final send, for the rest of the body (at most ``drain_limit`` bytes and
   ``drain_timeout`` seconds; QuartTrio keeps reading ``receive()`` until the response is
   complete, so the body is consumed meanwhile). The connection then stays usable for the
   next request. A body too large to drain gets ``Connection: close`` on the answer instead,
   and hypercorn closes the connection after it.

The guard also refuses a request framed two ways (``Content-Length`` and ``Transfer-Encoding``)
before the app sees it: h11 reads such a body by ``Transfer-Encoding`` and keeps the connection,
but a proxy in front may have framed it by ``Content-Length``, so what follows on the
connection is not known to be a request (request smuggling). RFC 9112 section 6.3: the server
may reject it and must close the connection after responding; the answer is a 400 with
``Connection: close`` (llhttp, the parser of uvicorn's httptools mode, rejects it too).
"""

from __future__ import annotations

from typing import Any

import orjson
import trio

from trillm.entrypoints.openai.http.errors import BadRequestError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Any  # async () -> Message
Send = Any  # async (Message) -> None

DEFAULT_DRAIN_LIMIT = 1024 * 1024
AMBIGUOUS_FRAMING = (
    "a request may not carry both Content-Length and Transfer-Encoding (its body's length "
    "would be ambiguous); send one of them"
)


class KeepAliveGuard:
    """ASGI wrapper: drain-or-close after an early answer; shield the final send."""

    def __init__(
        self, app: Any, drain_timeout: float, drain_limit: int = DEFAULT_DRAIN_LIMIT
    ) -> None:
        self.app = app
        self.drain_timeout = drain_timeout
        self.drain_limit = drain_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _framed_twice(scope):
            with trio.move_on_after(self.drain_timeout):
                await _drain(receive, self.drain_limit)
            await _refuse_and_close(send, AMBIGUOUS_FRAMING)
            return
        exchange = _Exchange(scope, receive, send, self.drain_timeout, self.drain_limit)
        await self.app(scope, exchange.receive, exchange.send)


class _Exchange:
    """One request/response on a connection, as seen between hypercorn and the app."""

    def __init__(
        self, scope: Scope, receive: Receive, send: Send, drain_timeout: float, drain_limit: int
    ) -> None:
        self._receive = receive
        self._send = send
        self._drain_timeout = drain_timeout
        self._drain_limit = drain_limit
        # Set once the request body is complete, the client is gone, or draining more would
        # read past ``drain_limit``: the final send waits for it, never longer.
        self._settled = trio.Event()
        self._received = 0
        self._declared = _content_length(scope)
        if not str(scope.get("http_version", "1.1")).startswith("1."):
            self._settled.set()  # HTTP/2 streams end on their own: nothing to keep in step

    async def receive(self) -> Message:
        message = await self._receive()
        kind = message["type"]
        if kind == "http.request":
            self._received += len(message.get("body", b""))
            if not message.get("more_body", False) or self._received > self._drain_limit:
                self._settled.set()
        elif kind == "http.disconnect":
            self._settled.set()
        return message

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self._settled.is_set():
            if self._declared is not None and self._declared - self._received > self._drain_limit:
                # Too much left to read: say so, and hypercorn closes after the answer.
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
                self._settled.set()  # nothing to wait for: the connection ends
        if kind == "http.response.body" and not message.get("more_body", False):
            if not self._settled.is_set():
                # An early answer: let the rest of the body arrive (the app reads it) so that
                # h11 can start the next cycle; past the timeout hypercorn closes instead.
                with trio.move_on_after(self._drain_timeout):
                    await self._settled.wait()
            # Shielded: hypercorn recycles or closes the connection inside this call, and
            # quart-trio cancels this task as soon as it sees the http.disconnect that the
            # same call emits (see the module docstring).
            with trio.CancelScope(shield=True):
                await self._send(message)
            return
        await self._send(message)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _framed_twice(scope: Scope) -> bool:
    names = {name.lower() for name, _ in scope.get("headers", ())}
    return b"content-length" in names and b"transfer-encoding" in names


async def _drain(receive: Receive, limit: int) -> None:
    """Reads the request body (as h11 frames it) until its end, the client's, or ``limit``."""
    received = 0
    while received <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        received += len(message.get("body", b""))


async def _refuse_and_close(send: Send, message: str) -> None:
    """A 400 in the API's error shape with ``Connection: close``: hypercorn (h11) closes the
    connection once it is sent, so nothing after this request on it is read as a request."""
    # NOTE: once the answer says close, h11 takes any byte after the body as an error and
    # hypercorn drops the connection then, cutting the answer short. The body is read first
    # (``_drain``); one checkpoint then lets hypercorn's reader, woken by that last read, park
    # on what follows (h11 PAUSED) before the answer starts.
    await trio.lowlevel.checkpoint()
    error = BadRequestError(message)
    body = orjson.dumps(error.body())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
