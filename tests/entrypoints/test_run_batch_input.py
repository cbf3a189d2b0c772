"""``trillm run-batch``'s input lines, from a file or an http(s) URL: a line longer than
MAX_LINE_BYTES is refused once that many bytes of it have arrived, never read whole first (an
endless line from a URL used to be buffered until it ended)."""

from __future__ import annotations

import http.server
import threading

import pytest
import trio

from trillm.entrypoints.openai import run_batch

LIMIT = 2**20
STREAMED = 64 * 2**20  # one line of this many bytes, no newline


class _LongLine(http.server.BaseHTTPRequestHandler):
    sent = 0

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(STREAMED))
        self.end_headers()
        block = b"a" * 2**16
        try:
            for _ in range(STREAMED // len(block)):
                self.wfile.write(block)
                type(self).sent += len(block)
        except OSError:
            pass  # the reader hung up

    def log_message(self, *args: object) -> None:
        pass


def _read_all(source: str) -> list[str]:
    async def main() -> list[str]:
        async with run_batch._input_lines(source) as lines:
            return [line async for line in lines]

    return trio.run(main)


def test_a_long_line_from_a_url_is_refused_before_it_is_read_whole(monkeypatch):
    monkeypatch.setattr(run_batch, "MAX_LINE_BYTES", LIMIT)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LongLine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(ValueError, match=f"longer than {LIMIT} bytes"):
            _read_all(f"http://127.0.0.1:{server.server_address[1]}/in.jsonl")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    # what was sent: the limit plus what the sockets buffer, far from the whole line
    assert _LongLine.sent < STREAMED // 2, _LongLine.sent


def test_file_lines_blank_lines_and_a_long_line(tmp_path, monkeypatch):
    monkeypatch.setattr(run_batch, "MAX_LINE_BYTES", LIMIT)
    monkeypatch.setattr(run_batch, "READ_CHUNK_BYTES", 7)  # lines across chunk boundaries
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"a": 1}\r\n\n  \n{"b": "\xc3\xa9"}\n{"c": 3}')
    assert _read_all(str(path)) == ['{"a": 1}', '{"b": "\u00e9"}', '{"c": 3}']
    monkeypatch.setattr(run_batch, "READ_CHUNK_BYTES", 2**16)
    path.write_bytes(b"{}\n" + b"x" * (LIMIT + 1) + b"\n")
    with pytest.raises(ValueError, match=f"longer than {LIMIT} bytes"):
        _read_all(str(path))
