"""The marks of the Ray tests (``pytestmark = RAY_TESTS``): skipped where Ray is not installed
(``pip install 'trillm[ray]'``: ~240 MB, not in the test extra), and one Ray file at a time (a
cluster started by one would be joined by the other's engines). Ray itself comes from the
``ray`` fixture (tests/parallel/conftest.py), never imported at collection."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

RAY_TESTS = [
    pytest.mark.skipif(find_spec("ray") is None, reason="Ray is not installed: trillm[ray]"),
    pytest.mark.xdist_group("ray"),
]
