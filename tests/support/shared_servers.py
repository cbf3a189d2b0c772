"""Servers shared by the test modules of one pytest worker, keyed by their flags.

A ``trillm serve`` start costs seconds of CPU (two processes import torch and transformers).
Modules that need a server with the same flags and leave it as they found it (no restarts,
no adapters loaded, no counters read as absolute values) share one: they ask the
``shared_server`` fixture (tests/conftest.py) for it and carry the same
``pytest.mark.xdist_group`` name, so that pytest-xdist runs them on one worker. Each server is
stopped when the worker's session ends, and must exit cleanly then.
"""

from __future__ import annotations

from pathlib import Path

from server_harness import ServerProcess

FAKE_RUNNER = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]


class ServerPool:
    """``get(args)`` starts ``trillm serve ARGS`` once per distinct flags; ``close()`` stops all."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._servers: dict[tuple[str, ...], ServerProcess] = {}

    def get(self, args: list[str]) -> ServerProcess:
        key = tuple(args)
        if key not in self._servers:
            log = self._log_dir / f"shared-server-{len(self._servers)}.log"
            self._servers[key] = ServerProcess(list(args), log).start()
        return self._servers[key]

    def close(self) -> list[str]:
        """Stop every server; the failures, each its flags, exit code and log tail."""
        failures = []
        for key, srv in self._servers.items():
            code = srv.stop()
            if code != 0:
                failures.append(f"trillm serve {' '.join(key)} exited {code}:\n{srv.log()}")
        self._servers.clear()
        return failures


# The shared servers: their flags, and the xdist group of the modules that use them.
FAKE_512_TEMPLATES = [*FAKE_RUNNER, "--max-model-len", "512", "--trust-request-chat-template"]
FAKE_512_TEMPLATES_GROUP = "shared-server-fake-512-templates"
FAKE_256 = [*FAKE_RUNNER, "--max-model-len", "256"]
FAKE_256_GROUP = "shared-server-fake-256"
