"""The ``model`` fixture of the parallel-architecture tests (``model(arch) -> path``), and
every multi-rank engine started in-process here forking its ranks from this worker's rank
zygote server (tests/support/rank_servers.py); the ``ray`` fixture of the Ray tests."""

from __future__ import annotations

import pytest
from parallel_models import biased_models
from rank_servers import ranks_from_one_zygote
from ray_marks import import_ray


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
    harness forks servers with them all the same (tests/support/server_harness.py). Ray's own
    unclosed log files and processes, collected later, fail no test (``import_ray``)."""
    return import_ray()


@pytest.fixture(scope="module")
def ray_cluster(ray):
    """One local Ray cluster for the module (started here, joined by every engine: each places
    its own group and actors and removes them), so that the cluster's start is paid once."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
