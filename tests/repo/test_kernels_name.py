"""The repository's ``kernels/`` folder is trillm's (``trillm.kernels``, through the
``trillm/kernels`` link); the top-level name ``kernels`` belongs to a PyPI package (Hugging
Face's hub kernels, which transformers probes for and imports). The folder has no
``__init__.py``: with the repository root on sys.path before site-packages (pytest's
``pythonpath``, ``python -m`` run from the root), it is only a namespace portion, so a regular
package ``kernels`` anywhere on the path wins, and without one transformers' probe sees a
namespace package and says "not installed". Each case runs a Python started in the root."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

# the repository root, wherever below tests/ this file sits
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").exists())
SITE = Path(sysconfig.get_paths()["purelib"])


def _python(code: str, *path: Path, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_folder_is_a_namespace_portion():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "trillm" / "kernels").resolve() == (ROOT / "kernels").resolve()


@pytest.mark.parametrize("via_symlink", [False, True])
def test_a_regular_kernels_package_wins_over_the_folder(tmp_path, via_symlink):
    root = ROOT
    if via_symlink:  # the root on sys.path under another name
        root = tmp_path / "checkout"
        root.symlink_to(ROOT, target_is_directory=True)
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('CUDAProperties = "the PyPI package"\n')
    code = (
        "import kernels, trillm.kernels.dispatch as dispatch\n"
        "print(kernels.__file__)\n"
        "print(kernels.CUDAProperties)\n"
        "print(dispatch.__name__, callable(dispatch.rms_norm))\n"
        "print(dispatch.__file__)\n"
    )
    lines = _lines(_python(code, root, tmp_path / "site"))  # the root first: it would shadow
    assert lines[:3] == [
        str(fake / "__init__.py"),
        "the PyPI package",
        "trillm.kernels.dispatch True",
    ]
    assert Path(lines[3]).resolve() == ROOT / "kernels" / "dispatch.py"  # trillm's own


# transformers' probe (transformers.utils.import_utils._is_package_available), step by step:
# find_spec; the distribution's version; else import it, and a module with neither __version__
# nor __file__ is a PEP 420 namespace package on sys.path, "not installed".
_PROBE = """
import importlib, importlib.metadata, importlib.util
spec = importlib.util.find_spec("kernels")
print(spec is not None)
try:
    print(importlib.metadata.version("kernels"))
except importlib.metadata.PackageNotFoundError:
    print("no distribution")
module = importlib.import_module("kernels")
print(getattr(module, "__file__", None), getattr(module, "__version__", None))
print(sorted(set(getattr(module, "__path__", []))))  # "" (the cwd) and the root: one folder
"""


def _site_without_kernels(tmp_path: Path) -> Path:
    """site-packages as links, less the PyPI ``kernels`` and its distribution metadata."""
    view = tmp_path / "site-packages"
    view.mkdir()
    for entry in SITE.iterdir():
        if entry.name == "kernels" or entry.name.lower().startswith("kernels-"):
            continue
        (view / entry.name).symlink_to(entry)
    return view


def test_probe_without_the_pypi_package_sees_a_namespace_package(tmp_path):
    view = _site_without_kernels(tmp_path)
    # -S: no site-packages but the view (so neither the PyPI package nor its metadata)
    lines = _lines(_python(_PROBE, ROOT, view, flags=("-S",)))
    assert lines == ["True", "no distribution", "None None", f"[{str(ROOT / 'kernels')!r}]"]


@pytest.mark.skipif(
    importlib.util.find_spec("kernels") is None, reason="the PyPI kernels is not installed"
)
def test_probe_with_the_pypi_package_finds_it():
    lines = _lines(_python(_PROBE, ROOT))
    assert lines[:2] == ["True", importlib.metadata.version("kernels")]
    file, version = lines[2].split()
    assert Path(file).is_relative_to(SITE) and version != "None"


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
def test_transformers_probe_without_the_pypi_package_says_not_available(tmp_path):
    view = _site_without_kernels(tmp_path)
    code = (
        "from transformers.utils import import_utils\n"
        "print(import_utils._is_package_available('kernels', return_version=True))\n"
        "print(import_utils.is_kernels_available())\n"
    )
    lines = _lines(_python(code, ROOT, view, flags=("-S",)))
    assert lines == ["(False, 'N/A')", "False"]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
def test_transformers_from_the_root_never_sees_the_folder():
    code = (
        "import importlib, transformers\n"
        "from transformers.utils import import_utils\n"
        "print(import_utils._is_package_available('kernels', return_version=True))\n"
        "import_utils.is_kernels_available()\n"
        "print(getattr(importlib.import_module('kernels'), '__file__', None))\n"
    )
    result = _python(code, ROOT)
    if importlib.util.find_spec("kernels") is None:
        assert result.stdout.splitlines()[0] == "(False, 'N/A')", result.stderr
        return
    probe, file = _lines(result)
    assert probe == f"(True, {importlib.metadata.version('kernels')!r})"
    assert Path(file).is_relative_to(SITE)  # the PyPI package, never the folder
