"""The HTTP server's socket and hypercorn's settings: the address is bound before the engine
starts (``reserve_listener``), hypercorn serves on that socket once the engine is up."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from typing import Any

from trillm.entrypoints.openai.http.deployment import configure_hypercorn
from trillm.entrypoints.openai.http.keepalive import KeepAliveGuard


class PortUnavailableError(OSError):
    """The server's address cannot be bound (in use, not this host's, no permission)."""


def reserve_listener(host: str, port: int, uds: str | None = None) -> socket.socket:
    """The server's socket, bound before the engine starts: the engine's processes open
    connections of their own while the model loads, and one of them could otherwise take the
    port (an ephemeral one) before the server binds it. Hypercorn listens on it once the engine
    is up; a port in use is reported at once, before anything loads. ``uds`` (--uds): a Unix
    domain socket at that path instead of host:port."""
    if uds is not None:
        return _reserve_unix(uds)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        message = f"cannot serve on {host}:{port}: {exc.strerror}"
        raise PortUnavailableError(exc.errno, message) from exc
    return sock


def _reserve_unix(path: str) -> socket.socket:
    """A Unix socket bound at ``path``; a socket file left there by an earlier server is
    replaced (as uvicorn and hypercorn do), any other file is not."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise PortUnavailableError(
                errno.EEXIST, f"cannot serve on --uds {path}: a file that is not a socket is there"
            )
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise PortUnavailableError(
            exc.errno, f"cannot serve on --uds {path}: {exc.strerror}"
        ) from exc
    return sock


async def hypercorn_serve(app: Any, config: Any, **kwargs: Any) -> None:
    from hypercorn.trio import serve

    # NOTE: quart-trio cancels hypercorn's keep-alive bookkeeping from inside the app's last
    # send (idle timeout lost after the first request, Connection: close and HTTP/1.0 ignored,
    # a connection answered before its body arrived left dead). KeepAliveGuard shields that
    # send and drains or closes; the upstream cause is written down in http_guard.py.
    guarded: Any = KeepAliveGuard(app, drain_timeout=config.keep_alive_timeout)
    _bad_framing_answers_400()
    await serve(guarded, config, **kwargs)


def _bad_framing_answers_400() -> None:
    """A request h11 cannot frame (an unknown ``Transfer-Encoding`` such as gzip, ``chunked``
    twice) is answered by hypercorn, before any app, with h11's status hint: 501 for the
    coding, as RFC 9112 section 6.1 suggests. It is the client's error, and bad input is a 4xx
    here (uvicorn, vLLM's server, answers 400 too): hypercorn's error answer maps 501 to 400.
    Idempotent (a restarted server in the same process installs it once)."""
    from hypercorn.protocol.h11 import H11Protocol

    original = H11Protocol._send_error_response
    if getattr(original, "trillm_400", False):
        return

    async def send_error_response(self: Any, status_code: int) -> None:
        await original(self, 400 if status_code == 501 else status_code)

    send_error_response.trillm_400 = True  # type: ignore[attr-defined]
    H11Protocol._send_error_response = send_error_response  # type: ignore[method-assign]


def hypercorn_config(opts: Any, listener: socket.socket) -> Any:
    """Hypercorn's settings for ``opts`` (api_server.ServerOptions), serving on ``listener``
    (``reserve_listener``'s socket), which hypercorn then owns: detached here."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{listener.detach()}"]
    config.loglevel = opts.log_level.upper()
    # Hypercorn's loggers propagate to the root logger ``trillm serve`` configures.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = (
        logging.getLogger("hypercorn.access")
        if opts.log_level.lower() in ("debug", "trace")
        else None
    )
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = opts.keep_alive_timeout
    # NOTE: hypercorn's default listen backlog (100) overflows when hundreds of clients connect
    # at once: the dropped SYNs are retried after 1 s, which lands in their TTFT. 2048 as uvicorn.
    config.backlog = 2048
    config.include_server_header = False
    configure_hypercorn(config, opts)  # --ssl-* (--root-path: deployment.RootPath)
    return config
