"""What ``vllm serve``'s deployment flags do to the running server (their parsing and checks:
``entrypoints/cli/vllm_flags.py``): TLS (``--ssl-*``) on hypercorn's config, CORS
(``--allowed-*``, always on as in vLLM), ``--root-path`` and the ``http_*`` metrics around the
app."""

from __future__ import annotations

from typing import Any

from trillm.entrypoints.openai.http.cors import CORSMiddleware
from trillm.entrypoints.openai.metrics.http import HTTPMetrics


def configure_hypercorn(config: Any, opts: Any) -> None:
    """TLS (``--ssl-*``) on hypercorn's config (``--root-path``: ``RootPath``)."""
    if opts.ssl_certfile:
        import ssl

        config.certfile = opts.ssl_certfile
        config.keyfile = opts.ssl_keyfile
        config.ca_certs = opts.ssl_ca_certs
        config.verify_mode = ssl.VerifyMode(opts.ssl_cert_reqs)


def wrap_asgi(app: Any, opts: Any, metrics: Any = None) -> Any:
    """The app behind CORS, as vLLM always serves it (default: every origin), and behind
    ``--root-path``; with ``metrics`` (ServerMetrics), counted in vLLM's ``http_*`` series."""
    if metrics is not None:
        app = HTTPMetrics(app, [rule.rule for rule in app.url_map.iter_rules()])
        metrics.registry.register(app)
    wrapped: Any = CORSMiddleware(
        app,
        opts.allowed_origins,
        opts.allowed_methods,
        opts.allowed_headers,
        opts.allow_credentials,
    )
    if opts.root_path:
        wrapped = RootPath(wrapped, opts.root_path.rstrip("/"))
    return wrapped


class RootPath:
    """``--root-path`` as uvicorn (vLLM's server) applies it: the proxy in front strips the
    prefix, so a request for ``/v1/models`` is served as ``/v1/models``; the prefix is the
    ``root_path`` of the ASGI scope and, as the ASGI spec and uvicorn have it, prepended to
    ``path`` (the framework strips it again for routing and adds it to the URLs it builds)."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path
        self.raw_root = root_path.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            raw = scope.get("raw_path") or scope["path"].encode()
            scope = {
                **scope,
                "root_path": self.root_path,
                "path": self.root_path + scope["path"],
                "raw_path": self.raw_root + raw,
            }
        await self.app(scope, receive, send)
