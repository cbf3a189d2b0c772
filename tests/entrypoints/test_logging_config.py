"""Logs a log shipper can read: ``--log-format json``, a dictConfig file named by
``TRILLM_LOGGING_CONFIG_PATH`` / vLLM's ``VLLM_LOGGING_CONFIG_PATH``, and
``*_CONFIGURE_LOGGING=0`` -- each against a real ``trillm serve``."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import httpx
import pytest
from server_harness import REPO, ServerProcess

from trillm.logging_config import JsonFormatter

FAKE = ["--runner", "trillm.worker.fake_runner:FakeModelRunner", "--disable-log-stats"]
TEXT_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR) ")


def test_json_formatter_fields_exception_and_extras():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.getLogger("t").makeRecord(
            "t",
            logging.ERROR,
            __file__,
            1,
            "value %d",
            (7,),
            sys.exc_info(),
            extra={"request_id": "r1", "obj": object()},
        )
    out = json.loads(JsonFormatter().format(record))
    assert out["level"] == "ERROR" and out["logger"] == "t" and out["message"] == "value 7"
    assert "RuntimeError: boom" in out["exception"]
    assert out["request_id"] == "r1" and out["obj"].startswith("<object object")
    assert out["time"].endswith("+00:00")


def _one_request(srv: ServerProcess) -> None:
    r = httpx.post(
        srv.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200, r.text


def test_log_format_json_makes_every_record_one_json_object(tmp_path):
    srv = ServerProcess(
        [*FAKE, "--log-format", "json", "--enable-log-requests"], tmp_path / "server.log"
    ).start()
    try:
        _one_request(srv)
    finally:
        assert srv.stop() == 0
    lines = [line for line in srv.log().splitlines() if line.strip()]
    assert not [line for line in lines if TEXT_RECORD.match(line)]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    received = [r for r in records if r["message"].startswith("Received request")]
    assert len(received) == 1 and received[0]["level"] == "INFO"
    assert any(r["logger"].startswith("trillm") for r in records)


def test_vllm_logging_config_path_is_used_as_is(tmp_path, monkeypatch):
    out = tmp_path / "records.jsonl"
    config = {
        "version": 1,
        "disable_existing_loggers": False,  # as in vLLM's documented example
        "formatters": {"json": {"()": "trillm.logging_config.JsonFormatter"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(out), "formatter": "json"}
        },
        "root": {"level": "INFO", "handlers": ["file"]},
    }
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(path))
    srv = ServerProcess([*FAKE, "--enable-log-requests"], tmp_path / "server.log").start()
    try:
        _one_request(srv)
    finally:
        assert srv.stop() == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r for r in records if r["message"].startswith("Received request")]
    assert "Received request" not in srv.log()  # the file's handler, not stderr's


def _serve_exit(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trillm", "serve", *FAKE, "--port", "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "content,why",
    [(None, "cannot read"), ("[1]", "must hold"), ("{", "not valid JSON"), ('{"version": 7}', "")],
)
def test_an_unusable_logging_config_exits_2_naming_it(tmp_path, content, why):
    path = tmp_path / "logging.json"
    if content is not None:
        path.write_text(content)
    result = _serve_exit({"TRILLM_LOGGING_CONFIG_PATH": str(path)})
    assert result.returncode == 2, result.stderr
    assert "logging configuration" in result.stderr and why in result.stderr


def test_configure_logging_0_leaves_logging_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TRILLM_CONFIGURE_LOGGING", "0")
    srv = ServerProcess([*FAKE, "--enable-log-requests"], tmp_path / "server.log").start()
    try:
        _one_request(srv)
    finally:
        assert srv.stop() == 0
    # No handler of trillm's: INFO records (the request log) go nowhere.
    assert "Received request" not in srv.log()


def test_vllm_logging_level_sets_trillms_loggers(tmp_path, monkeypatch):
    # WARNING silences trillm's INFO records (the request log) while the root stays at INFO.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "warning")
    srv = ServerProcess([*FAKE, "--enable-log-requests"], tmp_path / "server.log").start()
    try:
        _one_request(srv)
    finally:
        assert srv.stop() == 0
    log = srv.log()
    assert "Received request" not in log and " INFO trillm" not in log
    assert " INFO hypercorn.error: Running on" in log  # the root logger is still at INFO


def test_a_vllm_logging_level_that_is_no_level_exits_2_naming_it():
    result = _serve_exit({"VLLM_LOGGING_LEVEL": "LOUD"})
    assert result.returncode == 2, result.stderr
    assert "VLLM_LOGGING_LEVEL='LOUD'" in result.stderr
