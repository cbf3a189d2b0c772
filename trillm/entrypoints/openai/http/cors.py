"""CORS as vLLM serves it (``--allowed-origins/-methods/-headers``, ``--allow-credentials``).

vLLM puts Starlette's ``CORSMiddleware`` in front of every route with these flags (defaults:
every origin, method and header; no credentials). This ASGI wrapper follows the same rules:

- a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  here, before the app: browsers send it without credentials, so it must not meet the API-key
  gate, and the app itself routes no ``OPTIONS`` (``PROVIDE_AUTOMATIC_OPTIONS`` is off);
  a disallowed origin, method or header gets 400 naming which;
- any other request with an allowed ``Origin`` gets the CORS headers on its response, errors
  (401, 404, ...) and streams included.
"""

from __future__ import annotations

from typing import Any

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = {"accept", "accept-language", "content-language", "content-type"}
PREFLIGHT_MAX_AGE = "600"


class CORSMiddleware:
    def __init__(
        self,
        app: Any,
        allowed_origins: list[str],
        allowed_methods: list[str],
        allowed_headers: list[str],
        allow_credentials: bool = False,
    ) -> None:
        self.app = app
        self.all_origins = "*" in allowed_origins
        self.origins = set(allowed_origins)
        methods = ALL_METHODS if "*" in allowed_methods else allowed_methods
        self.methods = {m.upper() for m in methods}
        self.all_headers = "*" in allowed_headers
        self.headers = {h.lower() for h in allowed_headers} | SAFELISTED_HEADERS
        self.credentials = allow_credentials
        self.methods_value = ", ".join(sorted(self.methods)).encode()

    def origin_allowed(self, origin: str) -> bool:
        return self.all_origins or origin in self.origins

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _read_body(receive)  # (empty) read first: the connection stays in step
            await self._preflight(origin, headers, send)
            return
        if not self.origin_allowed(origin):
            await self.app(scope, receive, send)
            return
        extra = self._simple_headers(origin, "cookie" in headers)

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                added = [(k, v) for k, v in extra if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _allow_origin(self, origin: str, has_cookie: bool) -> list[tuple[bytes, bytes]]:
        # "*" only when nothing is credentialed; else the origin itself, and Vary on it.
        if self.all_origins and not self.credentials and not has_cookie:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    def _simple_headers(self, origin: str, has_cookie: bool) -> list[tuple[bytes, bytes]]:
        out = self._allow_origin(origin, has_cookie)
        if self.credentials:
            out.append((b"access-control-allow-credentials", b"true"))
        return out

    async def _preflight(self, origin: str, headers: dict[str, str], send: Any) -> None:
        problems = []
        if not self.origin_allowed(origin):
            problems.append("origin")
        if headers["access-control-request-method"].upper() not in self.methods:
            problems.append("method")
        requested = headers.get("access-control-request-headers", "")
        asked = [h.strip().lower() for h in requested.split(",") if h.strip()]
        if not self.all_headers and any(h not in self.headers for h in asked):
            problems.append("headers")
        if problems:
            body = f"Disallowed CORS {', '.join(problems)}".encode()
            await _respond(send, 400, [(b"content-type", b"text/plain; charset=utf-8")], body)
            return
        allow_headers = requested if self.all_headers else ", ".join(sorted(self.headers))
        out = self._allow_origin(origin, False)
        if self.all_origins and not self.credentials:
            out = [(b"access-control-allow-origin", b"*")]
        out += [
            (b"access-control-allow-methods", self.methods_value),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE.encode()),
            (b"content-type", b"text/plain; charset=utf-8"),
        ]
        if allow_headers:
            out.append((b"access-control-allow-headers", allow_headers.encode("latin-1")))
        if self.credentials:
            out.append((b"access-control-allow-credentials", b"true"))
        await _respond(send, 200, out, b"OK")


async def _read_body(receive: Any, limit: int = 64 * 1024) -> None:
    """Read a preflight's body (browsers send none) before answering: an answer given with the
    request unread leaves the keep-alive connection waiting for it (http_guard.py)."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def _respond(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
