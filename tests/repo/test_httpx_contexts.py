"""The suite's httpx clients share the default TLS context (tests/support/httpx_contexts.py,
installed by tests/conftest.py), and only it: another ``verify`` or CA setting gets its own."""

from __future__ import annotations

import ssl

import httpx


def _context(client: httpx.Client) -> ssl.SSLContext:
    return client._transport._pool._ssl_context  # type: ignore[attr-defined]


def test_default_clients_share_one_context_and_others_do_not(monkeypatch, tmp_path):
    with httpx.Client() as a, httpx.Client() as b, httpx.Client(verify=False) as c:
        assert _context(a) is _context(b)
        assert _context(c) is not _context(a) and _context(c).verify_mode == ssl.CERT_NONE
    import certifi

    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with httpx.Client() as d, httpx.Client() as e:
        assert _context(d) is _context(e) is not _context(a)
        assert _context(d).verify_mode == ssl.CERT_REQUIRED
