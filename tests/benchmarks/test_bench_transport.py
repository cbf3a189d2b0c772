"""The benchmark client's chunked-body decoder (the streaming hot path, without h11)."""

from __future__ import annotations

import random

import pytest

from trillm.bench.transport import TransportError, _ChunkedDecoder

PIECES = [b'data: {"a":1}\n\n', b"data: [DONE]\n\n" * 3, b"x" * 300, b"\r\n\r\n"]


def _chunked(pieces: list[bytes], tail: bytes = b"0\r\n\r\n") -> bytes:
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + tail


def test_any_split_of_the_body_decodes_the_same() -> None:
    body, want = _chunked(PIECES), b"".join(PIECES)
    rng = random.Random(0)
    for _ in range(500):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(0, 12)))
        decoder, out, prev = _ChunkedDecoder(), [], 0
        for cut in [*cuts, len(body)]:
            assert not decoder.complete
            out += decoder.feed(body[prev:cut])
            prev = cut
        assert b"".join(out) == want
        assert decoder.complete and decoder.excess == b""


def test_extensions_trailers_and_excess() -> None:
    decoder = _ChunkedDecoder()
    out = decoder.feed(b"5;name=v\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\nNEXT")
    assert out == [b"hello"] and decoder.complete and decoder.excess == b"NEXT"


def test_incomplete_body_is_not_complete() -> None:
    decoder = _ChunkedDecoder()
    assert decoder.feed(b"5\r\nhel") == [b"hel"]
    assert decoder.feed(b"lo\r\n0\r\n") == [b"lo"]
    assert not decoder.complete
    decoder.feed(b"\r\n")
    assert decoder.complete


@pytest.mark.parametrize("body", [b"zz\r\n", b"3\r\nabcX\r\n"])
def test_bad_framing_is_a_transport_error(body: bytes) -> None:
    with pytest.raises(TransportError):
        _ChunkedDecoder().feed(body)
