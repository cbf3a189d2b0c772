"""``trillm ... --help`` and the client commands' parsers import only what building the parser
needs: not the server (quart, hypercorn, trio), not the clients' HTTP library (httpx), not the
model side (torch, transformers, numpy). Each runs in a fresh interpreter, so what is loaded is
what the command loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("quart", "hypercorn", "trio", "httpx", "torch", "transformers", "numpy")


def modules_loaded_by(argv: list[str]) -> list[str]:
    """The HEAVY modules in ``sys.modules`` once ``python -m trillm ARGV`` has exited."""
    code = textwrap.dedent(f"""
        import json, runpy, sys
        sys.argv = ["trillm", *{argv!r}]
        try:
            runpy.run_module("trillm", run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)
    """)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "usage: trillm" in done.stdout  # the help was printed, not an error
    loaded: list[str] = json.loads(done.stderr.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["serve", "--help"],
        ["chat", "--help"],
        ["complete", "--help"],
        ["run-batch", "--help"],
        ["bench", "serve", "--help"],
    ],
    ids=" ".join,
)
def test_help_imports_no_server_client_or_model_library(argv):
    assert modules_loaded_by(argv) == []
