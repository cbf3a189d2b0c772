"""vLLM's other commands: ``trillm run-batch`` answers an OpenAI batch file as the server answers
each request, ``trillm chat`` / ``trillm complete`` talk to a running server, ``trillm
collect-env`` describes the machine.

One server (the embedded default model, real runner) is the reference: a batch line's answer
must equal what the same body gets over HTTP, field for field but the ids and timestamps.
"""

from __future__ import annotations

import ast
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from server_harness import ServerProcess, run_trillm, server_env

# The CLI clients send neither temperature nor max_tokens (as vLLM's): the generation config
# makes the server's defaults greedy and short.
GENERATION = Path(__file__).parent / "cli_generation_config.json"
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "2", "--generation-config", str(GENERATION)]
LOGGED = ["--enable-log-requests", "--max-log-len", "100000"]
VOLATILE = {"id", "created", "system_fingerprint"}

CHAT = {
    "model": "trillm-default",
    "messages": [{"role": "user", "content": "Say something."}],
    "max_tokens": 8,
    "temperature": 0,
}
PROMPTS = ["Once upon a time", "The capital of", "1, 2, 3,", "Hello", "A B C", "x y"]


def _completion(prompt: str) -> dict:
    return {"model": "trillm-default", "prompt": prompt, "max_tokens": 6, "temperature": 0}


def _line(custom_id: str, url: str, body: object, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _stable(answer: dict) -> dict:
    return {k: v for k, v in answer.items() if k not in VOLATILE}


def _trillm(*args: str, stdin: str | None = None, env: dict | None = None, timeout: float = 300):
    """A client command (``chat``, ``complete``): a process of its own, as it reads stdin."""
    return subprocess.run(
        [sys.executable, "-m", "trillm", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env or server_env(),
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([*FLAGS, *LOGGED], tmp_path_factory.mktemp("cli") / "server.log").start()
    yield srv
    assert srv.stop() == 0, srv.log()


# ---------------------------------------------------------------- run-batch


def test_run_batch_answers_each_line_as_the_server_does_in_the_input_order(server, tmp_path):
    """More lines than requests in flight (2 * --max-num-seqs = 4), in order; good lines equal
    the HTTP answers; a bad body gets the server's own 400 on its line; a line that is not a
    request (GET, unknown URL, stream, not JSON) gets a 400 naming why; none stops the batch."""
    lines = [_line("chat", "/v1/chat/completions", CHAT)]
    lines += [_line(f"c{i}", "/v1/completions", _completion(p)) for i, p in enumerate(PROMPTS)]
    lines += [
        _line("bad-body", "/v1/completions", {**_completion("x"), "max_tokens": -1}),
        _line("get", "/v1/completions", _completion("x"), method="GET"),
        _line("url", "/v1/files", {}),
        _line("stream", "/v1/completions", {**_completion("x"), "stream": True}),
        "this is not JSON",
        "",  # blank lines are skipped, as vLLM does
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    done = run_trillm(["run-batch", "-i", str(src), "-o", str(out), *FLAGS], tmp_path / "b.log")
    assert done.returncode == 0, done.output[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    ids = ["chat", *(f"c{i}" for i in range(len(PROMPTS))), "bad-body", "get", "url", "stream"]
    assert [r["custom_id"] for r in results] == [*ids, ""]
    assert len({r["id"] for r in results}) == len(results)

    with httpx.Client(base_url=server.url, timeout=120) as http:
        expected = [http.post("/v1/chat/completions", json=CHAT).json()]
        expected += [http.post("/v1/completions", json=_completion(p)).json() for p in PROMPTS]
        bad = http.post("/v1/completions", json={**_completion("x"), "max_tokens": -1})
    for got, want in zip(results, expected, strict=False):
        assert got["response"]["status_code"] == 200 and got["error"] is None
        assert _stable(got["response"]["body"]) == _stable(want)
    bad_line = results[len(expected)]
    assert bad_line["response"]["status_code"] == bad.status_code == 400
    assert bad_line["response"]["body"] is None and bad_line["error"] == bad.json()
    refusals = results[len(expected) + 1 :]
    assert all(r["response"]["status_code"] == 400 for r in refusals)
    for result, words in zip(refusals, ["'POST'", "'/v1/files'", "stream", "not JSON"]):
        assert words in result["error"], result


class _Files(http.server.BaseHTTPRequestHandler):
    """GET serves the input; PUT keeps the uploaded output."""

    body = b""
    uploaded: list[bytes] = []

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def do_PUT(self) -> None:  # noqa: N802
        self.uploaded.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_run_batch_reads_and_writes_http_urls(tmp_path):
    """An http(s) input is read with GET, an http(s) output uploaded with PUT (written first
    under --output-tmp-dir, which is left empty)."""
    _Files.body = (_line("only", "/v1/completions", _completion("Hello")) + "\n").encode()
    _Files.uploaded = []
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=files.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{files.server_address[1]}"
        staging = tmp_path / "staging"
        staging.mkdir()
        done = run_trillm(
            [
                "run-batch", "-i", f"{url}/in.jsonl", "-o", f"{url}/out.jsonl",
                "--output-tmp-dir", str(staging), *FLAGS,
            ],
            tmp_path / "b.log",
        )  # fmt: skip
    finally:
        files.shutdown()
        files.server_close()
    assert done.returncode == 0, done.output[-3000:]
    [upload] = _Files.uploaded
    [result] = [json.loads(line) for line in upload.decode().splitlines()]
    assert result["custom_id"] == "only" and result["response"]["status_code"] == 200
    assert result["response"]["body"]["choices"][0]["text"]
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--port", "9000"], "--port"),
        (["--api-key", "k"], "--api-key"),
        (["--root-path", "/llm"], "--root-path"),
        (["--output-tmp-dir", "/tmp"], "--output-tmp-dir"),
    ],
)
def test_run_batch_refuses_the_flags_of_a_listening_server_by_name(flags, named, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", "/v1/completions", _completion("x")) + "\n")
    args = ["run-batch", "-i", str(src), "-o", str(tmp_path / "o.jsonl"), *flags]
    done = run_trillm(args, tmp_path / "b.log")
    assert done.returncode == 2 and named in done.output, done.output
    assert not (tmp_path / "o.jsonl").exists()


def test_run_batch_needs_its_files(tmp_path):
    done = run_trillm(["run-batch", "-o", str(tmp_path / "o.jsonl")], tmp_path / "a.log")
    assert done.returncode == 2 and "--input-file" in done.output
    out = tmp_path / "o.jsonl"
    args = ["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(out), *FLAGS]
    missing = run_trillm(args, tmp_path / "b.log")
    assert missing.returncode == 1 and "nope.jsonl" in missing.output
    assert not out.exists()  # the input is opened first, before the model loads


# ---------------------------------------------------------------- chat / complete


def _logged_messages(server: ServerProcess) -> list[list[dict]]:
    """The messages of every chat request the server logged (--enable-log-requests)."""
    found = re.findall(r"\(chat[^)]*\): prompt: ('.*'|\".*\"), params:", server.log())
    return [json.loads(ast.literal_eval(shown)) for shown in found]


def test_chat_keeps_the_conversation_from_stdin_lines(server):
    """Two lines on stdin: the second turn is sent after the system prompt, the first line
    and the first answer (as printed), as the server's request log shows."""
    done = _trillm(
        "chat", "--url", f"{server.url}/v1", "--system-prompt", "Be brief.",
        stdin="Hi there\nAnd then?\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Using model: trillm-default" in done.stdout
    *_, first, second = _logged_messages(server)
    assert first == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert second[:2] == first and second[3] == {"role": "user", "content": "And then?"}
    body = {"model": "trillm-default", "messages": first}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert second[2] == {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
    assert second[2]["content"] in done.stdout


def test_complete_quick_prints_the_completion_and_stats(server):
    done = _trillm(
        "complete", "--url", f"{server.url}/v1", "--model-name", "trillm-default",
        "--max-tokens", "5", "--stats", "-q", "Once upon a time",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    body = {"model": "trillm-default", "prompt": "Once upon a time", "max_tokens": 5}
    want = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    assert want["choices"][0]["text"] in done.stdout
    assert "TTFT:" in done.stdout and "tokens/s (5 tokens" in done.stdout


def test_client_commands_send_the_key_and_report_a_refusal(tmp_path):
    """A server with a key: without it the command exits 1 with the server's message; with
    --api-key (or OPENAI_API_KEY) it answers."""
    srv = ServerProcess([*FLAGS, "--api-key", "sesame"], tmp_path / "keyed.log").start()
    try:
        url = f"{srv.url}/v1"
        refused = _trillm("complete", "--url", url, "--max-tokens", "2", "-q", "Hi")
        assert refused.returncode == 1 and "401" in refused.stderr, refused.stderr
        env = {**server_env(), "OPENAI_API_KEY": "sesame"}
        ok = _trillm("chat", "--url", url, "-q", "Hi", env=env)
        assert ok.returncode == 0 and "Using model: trillm-default" in ok.stdout, ok.stderr
    finally:
        assert srv.stop() == 0, srv.log()


# ---------------------------------------------------------------- collect-env


def test_collect_env_reports_versions_features_and_masks_secrets(tmp_path):
    import torch

    env = {**server_env(), "VLLM_API_KEY": "do-not-print", "TRILLM_WORKER_START": "spawn"}
    done = run_trillm(["collect-env"], tmp_path / "env.log", env=env, timeout=120)
    assert done.returncode == 0, done.output
    rows = {  # (the command writes nothing to stderr: every line is a row)
        name.strip(): value.strip()
        for name, value in (line.split("  ", 1) for line in done.output.splitlines())
    }
    assert rows["torch"] == torch.__version__
    assert rows["CPU cores usable"] == str(len(os.sched_getaffinity(0)))
    assert rows["env VLLM_API_KEY"] == "***" and "do-not-print" not in done.output
    assert rows["env TRILLM_WORKER_START"] == "spawn"
    assert "scheduler" in rows["native extensions"] or "none built" in rows["native extensions"]
