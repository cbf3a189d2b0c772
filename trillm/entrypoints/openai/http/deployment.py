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
    """``--root-path`` as vLLM applies it (FastAPI's ``root_path``): the prefix is the
    ``root_path`` of the ASGI scope, and a path is served with it or without it -- a proxy in
    front that strips it sends ``/v1/models``, one that does not, or a client that calls the
    server directly, ``/llm/v1/models``; both are ``/v1/models``, behind the same API key.
    As the ASGI spec has it, ``path`` holds the prefix (the framework strips it again for
    routing and adds it to the URLs it builds)."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path
        self.raw_root = root_path.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            path = scope["path"]
            raw = scope.get("raw_path") or path.encode()
            if not self.holds_prefix(path):
                path, raw = self.root_path + path, self.raw_root + raw
            scope = {**scope, "root_path": self.root_path, "path": path, "raw_path": raw}
        await self.app(scope, receive, send)

    def holds_prefix(self, path: str) -> bool:
        """``path`` starts with the prefix as whole segments (``/llm/v1``, not ``/llmx``)."""
        return path == self.root_path or path.startswith(self.root_path + "/")
