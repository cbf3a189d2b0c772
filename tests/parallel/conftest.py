"""The ``model`` fixture of the parallel-architecture tests (``model(arch) -> path``), and
every multi-rank engine started in-process here forking its ranks from this worker's rank
zygote server (tests/support/rank_servers.py)."""

from __future__ import annotations

import pytest
from parallel_models import biased_models
from rank_servers import ranks_from_one_zygote


@pytest.fixture(scope="module")
def model(tiny_model_factory, tmp_path_factory):
    return biased_models(tiny_model_factory, tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def _ranks_from_one_zygote():
    with ranks_from_one_zygote():
        yield
