"""Lint, format and types are part of the test command: ruff (with the ASYNC rules), ruff's
formatter and mypy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extras")
def test_ruff_lint_is_clean():
    result = run("ruff", "check", "trillm", "kernels", "tests", "benchmarks", "setup.py")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extras")
def test_ruff_format_is_applied():
    result = run(
        "ruff", "format", "--check", "trillm", "kernels", "tests", "benchmarks", "setup.py"
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    pytest.importorskip("mypy")
    # kernels/ is checked as trillm.kernels, through the trillm/kernels link
    result = run(sys.executable, "-m", "mypy", "trillm")
    assert result.returncode == 0, result.stdout + result.stderr
