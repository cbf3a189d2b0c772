"""A server forked from the test worker's zygote (tests/support/serve_zygote.py) behaves as
``python -m trillm serve`` started afresh: the same refusal and exit code for a bad flag, the
same program name in it, a server that answers and exits 0 on SIGTERM, an exit code seen by
``poll``/``wait`` only once the child has ended."""

from __future__ import annotations

import signal
import sys

import httpx
import pytest
from serve_zygote import ZygoteChild
from server_harness import ServerProcess, env_changes, server_env

FAKE = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]


def _refusal(tmp_path, launcher: list[str] | None) -> tuple[int, str]:
    srv = ServerProcess(["--no-such-flag"], tmp_path / f"{launcher is None}.log", launcher=launcher)
    with pytest.raises(RuntimeError, match="exited with"):
        srv.start()
    assert isinstance(srv.proc, ZygoteChild) == (launcher is None), env_changes(server_env())
    return srv.proc.wait(timeout=60), srv.log()


def test_a_bad_flag_is_refused_alike(tmp_path):
    forked = _refusal(tmp_path, None)
    fresh = _refusal(tmp_path, [sys.executable, "-m", "trillm"])
    assert forked[0] == fresh[0] == 2
    assert "error: unrecognized arguments: --no-such-flag" in forked[1]
    assert forked[1].splitlines()[-1] == fresh[1].splitlines()[-1]


def test_a_forked_server_serves_and_stops(tmp_path):
    srv = ServerProcess(FAKE, tmp_path / "server.log").start()
    try:
        assert isinstance(srv.proc, ZygoteChild), env_changes(server_env())
        assert srv.proc.poll() is None
        r = httpx.post(srv.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()
    assert "trillm stopped." in srv.log()
