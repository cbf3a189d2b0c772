"""One default TLS context for the tests' httpx calls, instead of one per call.

``httpx.get(...)`` / ``httpx.post(...)`` build a client per call, and each client's transport
builds an ``ssl.SSLContext`` loading the whole CA bundle (``load_verify_locations``): ~24 ms of
CPU per request even to an ``http://`` URL, which the suite pays on every request, /health
poll and /metrics scrape it sends that way (tens of thousands). ``install()`` makes the
default context (``verify=True``, no client certificate, the environment's CA settings) one
per CA setting, built once and shared: an ``SSLContext`` is safe to share between clients and
threads, and every call still opens its own connection, as before. Any other ``verify`` or
``cert`` (the TLS tests' own) is built as httpx builds it.
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Any

from httpx import _config
from httpx._transports import default as _transport

_BUILD = _config.create_ssl_context


@functools.lru_cache(maxsize=8)
def _default_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    return _BUILD()  # reads SSL_CERT_FILE / SSL_CERT_DIR, the key of this cache


def _create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
    if verify is True and cert is None and trust_env:
        return _default_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    return _BUILD(verify=verify, cert=cert, trust_env=trust_env)


def install() -> None:
    _transport.create_ssl_context = _create_ssl_context
