"""``trillm serve --headless``: a rank process that cannot start leaves no descriptor behind."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from trillm.entrypoints.cli import headless


def test_a_failed_rank_start_closes_both_ends_of_the_parent_death_pipe(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no processes left")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    before = sorted(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(OSError, match="no processes left"):
            headless.run_headless(None, {"nnodes": 2, "node_rank": 1, "tensor_parallel_size": 2})
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert sorted(os.listdir("/proc/self/fd")) == before
