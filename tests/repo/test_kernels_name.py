"""The repository's ``kernels/`` folder is trillm's (installed as ``trillm.kernels``); the
top-level name ``kernels`` belongs to a PyPI package (Hugging Face's hub kernels, which
transformers >= 5.25 requires and imports). With the repository root on sys.path before
site-packages (pytest's ``pythonpath``, ``python -m`` run from the root), ``import kernels``
must still give that package, or fail as a missing module does: never this folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("via_symlink", [False, True])
def test_import_kernels_gives_the_installed_package_not_this_folder(tmp_path, via_symlink):
    root = ROOT
    if via_symlink:  # the root on sys.path under another name
        root = tmp_path / "checkout"
        root.symlink_to(ROOT, target_is_directory=True)
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('CUDAProperties = "the PyPI package"\n')
    code = (
        "import kernels, trillm.kernels\n"
        "print(kernels.__file__)\n"
        "print(kernels.CUDAProperties)\n"
        "print(trillm.kernels.__file__, callable(trillm.kernels.rms_norm))\n"
    )
    result = _python(code, root, tmp_path / "site")  # the root first: it would shadow
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str(fake / "__init__.py")
    assert lines[1] == "the PyPI package"
    assert lines[2] == f"{ROOT / 'kernels' / '__init__.py'} True"  # trillm's own, unchanged


def test_import_kernels_without_the_package_is_a_missing_module():
    code = (
        "import importlib.metadata, sys\n"
        "try:\n"
        "    importlib.metadata.version('kernels')\n"
        "    sys.exit(3)\n"  # the PyPI package is installed here: the test above covers it
        "except importlib.metadata.PackageNotFoundError:\n"
        "    pass\n"
        "import kernels\n"
    )
    result = _python(code, ROOT)
    if result.returncode == 3:
        installed = _python(
            f"import kernels; print(kernels.__file__.startswith({str(ROOT / 'kernels')!r}))", ROOT
        )
        assert installed.returncode == 0 and installed.stdout.strip() == "False", installed
        return
    assert result.returncode == 1
    assert "ModuleNotFoundError: No module named 'kernels'" in result.stderr
