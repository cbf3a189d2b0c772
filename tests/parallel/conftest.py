"""The ``model`` fixture of the parallel-architecture tests: ``model(arch) -> path``."""

from __future__ import annotations

import pytest
from parallel_models import biased_models


@pytest.fixture(scope="module")
def model(tiny_model_factory, tmp_path_factory):
    return biased_models(tiny_model_factory, tmp_path_factory)
