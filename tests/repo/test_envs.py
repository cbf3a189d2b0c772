"""The environment variables: declared in one place (``trillm/envs.py``), read nowhere else,
listed in ``docs/environment.md``, and a value a variable does not take is refused naming it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trillm import envs

ROOT = Path(__file__).resolve().parents[2]
# Read for what they are, not as trillm's settings (docs/environment.md says why).
NOT_SETTINGS = {
    "PYTHONPATH",
    "OMP_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
    "HF_HUB_CACHE",
    "OPENAI_API_KEY",
}


def _environment_reads(tree: ast.AST) -> list[str]:
    """The first argument of every os.environ.get / os.environ[...] / os.getenv in ``tree``
    (its text for a constant, ``<expr>`` otherwise)."""
    found = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            reads = (("os.environ", "get"), ("os", "getenv"), ("os.environ", "setdefault"))
            if (owner, node.func.attr) in reads and node.args:
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            arg = node.slice
        elif isinstance(node, ast.Compare) and any(
            ast.unparse(c) == "os.environ" for c in node.comparators
        ):
            arg = node.left
        if arg is not None:
            found.append(arg.value if isinstance(arg, ast.Constant) else "<expr>")
    return found


def test_no_module_but_envs_reads_a_setting():
    offenders = []
    for path in [*ROOT.joinpath("trillm").rglob("*.py"), *ROOT.joinpath("kernels").glob("*.py")]:
        if path.name == "envs.py" and path.parent.name == "trillm":
            continue
        for name in _environment_reads(ast.parse(path.read_text())):
            if name not in NOT_SETTINGS:
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, "read these through trillm/envs.py: " + ", ".join(offenders)


def test_the_check_finds_a_read():
    """The control: the scan sees each form of a read."""
    code = 'import os\nos.environ.get("TRILLM_X")\nos.environ["VLLM_Y"]\nos.getenv(name)\n'
    assert _environment_reads(ast.parse(code)) == ["TRILLM_X", "VLLM_Y", "<expr>"]


def test_every_variable_is_documented():
    doc = (ROOT / "docs" / "environment.md").read_text()
    for var in envs.ALL:
        for name in var.names:
            assert f"`{name}`" in doc, name


@pytest.mark.parametrize(
    ("var", "text", "value"),
    [
        (envs.API_KEY, "", None),
        (envs.API_KEY, "k", "k"),
        (envs.XGRAMMAR_CACHE_MB, "64", 64),
        (envs.ALLOW_RUNTIME_LORA_UPDATING, "True", True),
        (envs.ALLOW_RUNTIME_LORA_UPDATING, "yes", False),  # vLLM's reading
        (envs.CONFIGURE_LOGGING, "0", False),
        (envs.NO_EXTENSIONS, "yes", True),
        (envs.NO_EXTENSIONS, "0", False),
        (envs.WORKER_START, "spawn", "spawn"),
        (envs.WORKER_START, "", "zygote"),
        (envs.PP_MICRO_BATCHES, "2", 2),
        (envs.CPU_ATTENTION_THREADS, " 3 ", 3),
    ],
)
def test_values_taken(monkeypatch, var, text, value):
    monkeypatch.setenv(var.name, text)
    assert var.get() == value
    monkeypatch.delenv(var.name)
    assert var.get() == var.default


@pytest.mark.parametrize(
    ("var", "text"),
    [
        (envs.XGRAMMAR_CACHE_MB, "0"),
        (envs.XGRAMMAR_CACHE_MB, "1.5"),
        (envs.NO_EXTENSIONS, "maybe"),
        (envs.WORKER_START, "fork"),
        (envs.PP_MICRO_BATCHES, "-1"),
        (envs.CPU_ATTENTION_THREADS, "lots"),
        (envs.CPU_ATTENTION_THREADS, "0"),
    ],
)
def test_values_refused_naming_the_variable(monkeypatch, var, text):
    monkeypatch.setenv(var.name, text)
    with pytest.raises(ValueError, match=var.name):
        var.get()
    with pytest.raises(ValueError, match=var.name):
        envs.check_all()


def test_trillm_wins_over_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert envs.CONFIGURE_LOGGING.get() is False
    monkeypatch.setenv("TRILLM_CONFIGURE_LOGGING", "1")
    assert envs.CONFIGURE_LOGGING.get() is True


def test_serve_refuses_a_bad_value_at_start_up():
    env = {**os.environ, "TRILLM_CPU_ATTENTION_THREADS": "lots", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "trillm", "serve"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "TRILLM_CPU_ATTENTION_THREADS must be a whole number > 0; got 'lots'" in out.stderr
