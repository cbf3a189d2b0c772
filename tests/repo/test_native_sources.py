"""A Cython declaration file sits beside the code it declares: every ``.pxd`` next to a
``.pyx`` of the same stem (both in ``ext/``). Cython itself looks a ``.pxd`` up by its module's
qualified name (``trillm/_ext/<name>.pxd``), so ``setup.py`` stages each ``ext/<name>.pxd``
there for the compile instead of the file living in the package, away from its source."""

from __future__ import annotations

import os
from pathlib import Path

# the repository root, wherever below tests/ this file sits
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").exists())
# build outputs, environments and tool caches: not the repository's own files
SKIPPED = {"build", "dist", "node_modules", "__pycache__"}


def _files(suffix: str) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED and not d.startswith(".")]
        found += [Path(folder, f) for f in files if f.endswith(suffix)]
    return sorted(found)


def test_every_pxd_sits_beside_a_pyx_of_its_stem():
    pxds = _files(".pxd")
    assert pxds, "no .pxd found: the check would be vacuous"
    strays = [str(p.relative_to(ROOT)) for p in pxds if not p.with_suffix(".pyx").is_file()]
    assert strays == [], f"a .pxd away from its .pyx (put it beside it, in ext/): {strays}"
