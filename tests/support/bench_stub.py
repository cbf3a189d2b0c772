"""What the ``trillm bench`` tests share: ``StubServer``, a stdlib OpenAI-compatible SSE
server (a test double for the remote server the harness targets) that streams deterministic
chunks with known delays, so TTFT/ITL can be checked against the delays it sleeps; the
harness run forked from the worker's serve zygote (``run_bench``) or as a process of its own
(``run_bench_process``); its usual flags (``common_args``); and a ShareGPT file
(``write_sharegpt``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

from server_harness import run_trillm

REPO = Path(__file__).resolve().parents[2]
FIRST_DELAY_S = 0.20  # the stub's time to first token
GAP_S = 0.05  # the stub's gap between chunks
MODEL = "stub-model"
SERVE_KEYS = (
    "completed failed total_input_tokens total_output_tokens request_throughput request_goodput "
    "output_throughput total_token_throughput max_output_tokens_per_s max_concurrent_requests "
    "duration input_lens output_lens ttfts itls generated_texts errors"
).split() + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")
]


class _StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # close-delimited bodies: no chunked encoding to write

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: StubServer = self.server.owner  # type: ignore[attr-defined]
        n = server.count_request(body, dict(self.headers))
        if body.get("model") not in server.models:
            self._json(
                404, {"error": {"message": f"The model {body.get('model')} does not exist."}}
            )
            return
        if server.fail_every and n % server.fail_every == 0:
            self._json(500, {"error": {"message": "stub failure"}})
            return
        self._stream(body, self.path.endswith("chat/completions"))

    def _send_event(self, payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _stream(self, body: dict, chat: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        max_tokens = body.get("max_completion_tokens" if chat else "max_tokens")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if chat:  # a role-only first chunk, as OpenAI sends: not a token
            self._send_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        time.sleep(FIRST_DELAY_S)
        server: StubServer = self.server.owner  # type: ignore[attr-defined]
        for i in range(server.num_chunks(max_tokens)):
            if i:
                time.sleep(GAP_S)
            text = f"t{i} "
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            self._send_event({"choices": [choice]})
        if server.send_usage:
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
            self._send_event({"choices": [], "usage": usage})
        self._send_event("[DONE]")


class _QuietServer(ThreadingHTTPServer):
    request_queue_size = 1024  # listen backlog: hundreds of streams connect at once

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up mid-stream (Ctrl-C test) is expected


class StubServer:
    """Streams ``max_tokens`` tokens as chunks of ``tokens_per_chunk``: first after
    FIRST_DELAY_S, then one every GAP_S; a usage chunk at the end unless ``send_usage=False``;
    every ``fail_every``-th request answers HTTP 500."""

    def __init__(
        self,
        fail_every: int = 0,
        tokens_per_chunk: int = 1,
        send_usage: bool = True,
        port: int = 0,
        models: tuple[str, ...] = (MODEL,),
    ) -> None:
        self.fail_every = fail_every
        self.tokens_per_chunk = tokens_per_chunk
        self.send_usage = send_usage
        self.models = models  # the names a request's 'model' may have
        self.bodies: list[dict] = []
        self.headers: list[dict] = []  # each request's headers, as bodies
        self._lock = threading.Lock()
        self.httpd = _QuietServer(("127.0.0.1", port), _StubHandler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def num_chunks(self, max_tokens: int) -> int:
        return -(-max_tokens // self.tokens_per_chunk)

    def count_request(self, body: dict, headers: dict | None = None) -> int:
        with self._lock:
            self.bodies.append(body)
            self.headers.append({k.lower(): v for k, v in (headers or {}).items()})
            return len(self.bodies)

    def __enter__(self) -> StubServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def bench_env() -> dict[str, str]:
    # NOTE: the repo root on the path, whatever the cwd: the harness runs as `-m trillm.bench`.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run_bench(args: list[str], timeout: float = 120) -> SimpleNamespace:
    """``trillm bench serve ARGS`` (the parser ``python -m trillm.bench serve`` has) forked from
    the worker's serve zygote, not a python importing the harness each time: ``returncode`` and
    ``output`` (stdout and stderr together)."""
    with tempfile.TemporaryDirectory() as tmp:
        return run_trillm(["bench", "serve", *args], Path(tmp) / "bench.log", timeout=timeout)


def run_bench_process(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m trillm.bench serve ARGS`` in a process of its own, ResourceWarnings shown
    (Python hides them by default): what the harness leaves to the garbage collector appears
    in its stderr."""
    return subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-m", "trillm.bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=bench_env(),
    )


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def common_args(url: str, out: Path, n: int, out_len: int, name: str = "r.json") -> list[str]:
    return [
        "--base-url",
        url,
        "--num-prompts",
        str(n),
        "--random-input-len",
        "16",
        "--random-output-len",
        str(out_len),
        "--result-dir",
        str(out),
        "--result-filename",
        name,
        "--save-result",
        "--save-detailed",
        "--disable-tqdm",
    ]


def write_sharegpt(path: Path, pairs: list[tuple[str, str]]) -> None:
    data = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
        }
        for i, (q, a) in enumerate(pairs)
    ]
    data.append({"id": "lonely", "conversations": [{"from": "human", "value": "no reply here"}]})
    path.write_text(json.dumps(data))
