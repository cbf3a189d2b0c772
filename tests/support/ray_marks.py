"""The marks of the Ray tests (``pytestmark = RAY_TESTS``): skipped where Ray is not installed
(``pip install 'trillm[ray]'``), and one Ray file at a time (a cluster started by one would be
joined by the other's engines). Ray itself comes from the ``ray`` fixture
(tests/parallel/conftest.py, ``import_ray``), never imported at collection."""

from __future__ import annotations

import sys
from importlib.util import find_spec
from typing import Any

import pytest

RAY_TESTS = [
    pytest.mark.skipif(find_spec("ray") is None, reason="Ray is not installed: trillm[ray]"),
    pytest.mark.xdist_group("ray"),
]


def import_ray() -> Any:
    """Ray, with the objects Ray itself leaves to the collector kept out of the tests' errors:
    the log files ``ray.init`` opens for each process it starts (ray/_private/node.py never
    closes them: ``ResourceWarning: unclosed file .../ray/session_.../logs/raylet.err``) and the
    ``Popen`` of a process ``ray.shutdown`` stopped without waiting for it ("subprocess N is
    still running"). pytest turns such unraisable warnings into errors of whichever test is
    running when they are collected; any other object's still fails that test."""
    import ray

    hook = sys.unraisablehook
    if not getattr(hook, "drops_ray_leftovers", False):

        def unraisable(args: Any) -> None:
            if not _rays_leftover(args):
                hook(args)

        unraisable.drops_ray_leftovers = True  # type: ignore[attr-defined]
        sys.unraisablehook = unraisable
    return ray


def _rays_leftover(args: Any) -> bool:
    if not isinstance(args.exc_value, ResourceWarning):
        return False
    name = getattr(args.object, "name", None)
    if isinstance(name, str) and "/ray/session_" in name:  # one of Ray's processes' logs
        return True
    tb = args.exc_traceback
    while tb is not None:  # Popen.__del__ of a Ray process (ray._private.services)
        owner = tb.tb_frame.f_locals.get("self")
        if type(owner).__module__.startswith("ray."):
            return True
        tb = tb.tb_next
    return False
