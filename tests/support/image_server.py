"""A local HTTP server (127.0.0.1, a thread) for image URL tests: the image, redirects (to
itself, to another host name, in a loop), a body over the size limit (claimed and streamed),
a non-image content type, and a URL that never answers until the server stops."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from trillm.engine.media import MAX_IMAGE_BYTES


class ImageServer:
    def __init__(self, image: bytes, audio: bytes = b"") -> None:
        self.audio = audio  # served as /audio.wav (audio/wav)
        self.image = image
        self.release = threading.Event()  # set when stopping: the hanging handler returns
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.route(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = False  # server_close() joins the handlers (sockets closed)
        self.httpd.block_on_close = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> ImageServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def route(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path
        if path == "/img.png":
            self._send(h, 200, "image/png", self.image)
        elif path == "/audio.wav":
            self._send(h, 200, "audio/wav", self.audio)
        elif path == "/text":
            self._send(h, 200, "text/html; charset=utf-8", b"<html>not an image</html>")
        elif path == "/missing":
            self._send(h, 404, "text/plain", b"no")
        elif path.startswith("/redirect/"):  # /redirect/<n>: n hops, then the image
            n = int(path.rsplit("/", 1)[1])
            self._redirect(h, f"/redirect/{n - 1}" if n > 1 else "/img.png")
        elif path == "/elsewhere":  # the same server under another host name
            self._redirect(h, self.url("/img.png", host="localhost"))
        elif path == "/claims-big":
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Content-Length", str(MAX_IMAGE_BYTES + 1))
            h.end_headers()
            h.wfile.write(self.image)
        elif path == "/streams-big":  # no length: the body runs past the limit
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Connection", "close")
            h.end_headers()
            block = b"\0" * (1 << 20)
            try:
                for _ in range(MAX_IMAGE_BYTES // len(block) + 2):
                    h.wfile.write(block)
            except OSError:
                pass  # the client stopped reading at the limit
        elif path == "/hang":
            self.release.wait(60)
        else:
            self._send(h, 404, "text/plain", b"unknown")

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, ctype: str, body: bytes) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _redirect(h: BaseHTTPRequestHandler, location: str) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
