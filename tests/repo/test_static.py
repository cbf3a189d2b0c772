"""Lint, format and types are part of the test command: ruff (with the ASYNC rules), ruff's
formatter and mypy."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("trillm", "kernels", "tests", "benchmarks", "setup.py")
CHECKS = {
    "ruff check": ("ruff", "check", *PATHS),
    "ruff format": ("ruff", "format", "--check", *PATHS),
    # kernels/ is checked as trillm.kernels, through the trillm/kernels link
    "mypy": (sys.executable, "-m", "mypy", "trillm"),
}
no_ruff = pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extras")


def _installed(command: tuple[str, ...]) -> bool:
    if command[0] == sys.executable:
        return importlib.util.find_spec(command[2]) is not None
    return shutil.which(command[0]) is not None


@pytest.fixture(scope="module")
def checks():
    """The three checks, started together: mypy's run from a fresh clone (no cache) is the
    long one, and the ruff runs go beside it rather than before it."""
    procs = {
        name: subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, command in CHECKS.items()
        if _installed(command)
    }
    yield procs
    for proc in procs.values():
        if proc.returncode is None:  # a check no test waited for (deselected, skipped)
            proc.kill()
            proc.communicate()


def outcome(checks, name: str) -> tuple[int, str]:
    """The exit code and the output (stdout and stderr) of check ``name``."""
    output, _ = checks[name].communicate(timeout=600)
    return checks[name].returncode, output


@no_ruff
def test_ruff_lint_is_clean(checks):
    code, output = outcome(checks, "ruff check")
    assert code == 0, output


@no_ruff
def test_ruff_format_is_applied(checks):
    code, output = outcome(checks, "ruff format")
    assert code == 0, output


def test_mypy_is_clean(checks):
    pytest.importorskip("mypy")
    code, output = outcome(checks, "mypy")
    assert code == 0, output
