"""The ``model`` fixture of the parallel-architecture tests (``model(arch) -> path``), and
every multi-rank engine started in-process here forking its ranks from this worker's rank
zygote server (tests/support/rank_servers.py); the ``ray`` fixture of the Ray tests."""

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


@pytest.fixture(scope="module")
def ray():
    """Ray, imported by the module that asks, never at collection. Ray writes variables into
    the process's environment (``RAY_CLIENT_MODE`` on import; ``RAY_USAGE_STATS_ENABLED``,
    ``RAY_AUTH_MODE``, ``PYTHONBREAKPOINT`` on ``ray.init``); they stay (removing them between
    the Ray modules made the next module's cluster lose its first actor), and the server
    harness forks servers with them all the same (tests/support/server_harness.py)."""
    import ray as ray_module

    return ray_module
