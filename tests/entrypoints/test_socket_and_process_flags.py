"""vLLM's ``--uds`` (serve on a Unix domain socket), ``--api-server-count`` (one process here:
1 accepted, more refused) and ``--show-hidden-metrics-for-version`` (nothing hidden: said once)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_harness import server_env

from trillm.entrypoints.cli.main import build_parser
from trillm.entrypoints.cli.vllm_flags import startup_notes

FLAGS = ["--max-model-len", "128", "--max-num-seqs", "2"]


def _serve(*args: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trillm", "serve", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=server_env(),
        start_new_session=True,
    )


def _accepts(path: Path) -> bool:
    """Whether a server listens on the Unix socket at ``path`` (a probe of our own: httpcore
    leaves the socket of a Unix connection that fails to the garbage collector)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def _wait_healthy(client: httpx.Client, path: Path, proc: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            if _accepts(path) and client.get("/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy:\n" + log_path.read_text()[-3000:])


def test_uds_serves_on_the_socket_file_and_replaces_a_stale_one(tmp_path):
    """A stale socket file at the path is replaced; the server answers a completion through
    the socket and says where it serves; SIGTERM stops it cleanly."""
    path = tmp_path / "trillm.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays: what a killed server leaves behind
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = _serve("--uds", str(path), *FLAGS, log=log)
    transport = httpx.HTTPTransport(uds=str(path))
    try:
        with httpx.Client(transport=transport, base_url="http://trillm", timeout=120) as client:
            _wait_healthy(client, path, proc, log_path)
            body = {"model": "trillm-default", "prompt": "Hello", "max_tokens": 3}
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 3
        assert f"trillm is serving trillm-default on http://unix:{path}" in log_path.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]


def test_uds_over_a_regular_file_is_refused_before_loading(tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("keep me")
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = _serve("--uds", str(path), *FLAGS, log=log)
    assert proc.wait(timeout=120) == 1
    assert "not a socket" in log_path.read_text() and path.read_text() == "keep me"


def _parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_uds_with_a_port_is_refused(capsys):
    from trillm.entrypoints.cli.vllm_flags import check_flags

    parser = build_parser()
    args = parser.parse_args(["serve", "--uds", "/tmp/x.sock", "--port", "9000"])
    with pytest.raises(SystemExit) as exit_:
        check_flags(args.serve_parser, args)
    assert exit_.value.code == 2 and "--uds" in capsys.readouterr().err
    default_port = parser.parse_args(["serve", "--uds", "/tmp/x.sock", "--port", "8000"])
    check_flags(default_port.serve_parser, default_port)  # vLLM's command lines still start


def test_api_server_count_one_is_accepted_more_refused_by_name(capsys):
    assert _parse("--api-server-count", "1").api_server_count == "1"
    assert _parse("-asc", "1").api_server_count == "1"
    with pytest.raises(SystemExit) as exit_:
        _parse("--api-server-count", "4")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--api-server-count" in err and "not implemented" in err


def test_show_hidden_metrics_for_version_is_said_once():
    notes = startup_notes(_parse("--show-hidden-metrics-for-version", "0.10"))
    assert notes == [
        "--show-hidden-metrics-for-version 0.10: trillm hides no metrics; all of them are on "
        "/metrics."
    ]
