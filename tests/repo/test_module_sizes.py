"""Small modules: no tracked Python file over 400 lines in ``trillm/``, none over 600 in
``tests/``. A file over its limit is split by responsibility, not trimmed. Only the files of
HEAD's tree count (their working-tree text), so another engineer's untracked work in progress
does not fail this test. HEAD's tree rather than ``git ls-files``: commits made through a
private index leave the shared index behind HEAD, without the files they added."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"trillm": 400, "tests": 600}  # top folder -> most lines a .py file there may have


def tracked_line_counts(folder: str) -> dict[str, int]:
    """Each ``.py`` file of HEAD's tree under ``folder`` -> its number of lines."""
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "-z", "--name-only", "HEAD", "--", folder],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    # A tracked file deleted in the working tree is no longer part of the package.
    names = [name for name in listed.split("\0") if name.endswith(".py")]
    paths = [name for name in names if (ROOT / name).is_file()]
    return {name: len((ROOT / name).read_text(encoding="utf-8").splitlines()) for name in paths}


def oversized(counts: dict[str, int], limit: int) -> list[str]:
    """'path: N lines' for each file over ``limit`` lines, longest first."""
    over = sorted(counts, key=lambda name: (-counts[name], name))
    return [f"{name}: {counts[name]} lines" for name in over if counts[name] > limit]


def test_oversized_names_each_file_over_the_limit_with_its_count():
    counts = {"a.py": 400, "b.py": 401, "c.py": 12, "d.py": 650}
    assert oversized(counts, 400) == ["d.py: 650 lines", "b.py: 401 lines"]
    assert oversized(counts, 650) == []


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
@pytest.mark.parametrize("folder", sorted(LIMITS))
def test_no_tracked_module_is_over_its_limit(folder):
    counts = tracked_line_counts(folder)
    assert len(counts) > 20, f"HEAD's tree has {len(counts)} Python files in {folder}/"
    over = oversized(counts, LIMITS[folder])
    assert not over, (
        f"over {LIMITS[folder]} lines in {folder}/ (split by responsibility):\n" + "\n".join(over)
    )
