"""Each xdist group's recorded time, for ordering the groups longest first (tests/conftest.py).

``group_durations.json`` holds seconds per group, written by a run of the whole suite with
``TRILLM_RECORD_GROUP_DURATIONS=tests/support/group_durations.json python -m pytest``: the
controller sums setup + call + teardown of every test of a group (on one worker, so the sum is
the group's wall time there). Rerun it when files are added or get slower; a group missing from
the file is scheduled first, so a stale file costs balance, never a test.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("group_durations.json")


def load_durations() -> dict[str, float]:
    if not DURATIONS.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}


def group_of(nodeid: str) -> str:
    """The group pytest-xdist appended to a node id (``path::test@group``), else the file."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[1]
    return nodeid.split("::", 1)[0]


class Recorder:
    """On the controller: sums each report's duration per group; writes them, rounded, sorted."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[group_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = dict(sorted(self.seconds.items(), key=lambda kv: -kv[1]))
        text = json.dumps({k: round(v, 1) for k, v in ordered.items()}, indent=0)
        self.path.write_text(text + "\n")
