"""Shared fixtures: tiny Hugging Face checkpoints built once per test session, the default
model's tokenizer, torch on one thread for modules of tiny tensors, and a Python subprocess
with the native extensions switched off."""

from __future__ import annotations

import os
import sys

import httpx_contexts
import pytest

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run under the interpreter. NOTE: triton reads the variable when
# a kernel is defined, so it is set before any test module imports triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# httpx's per-call clients share one default TLS context (tests/support/httpx_contexts.py):
# each would load the CA bundle again, ~24 ms of CPU per request.
httpx_contexts.install()
# Under pytest-xdist the workers share the cores: each worker (and every server or model worker
# it starts, which read OMP_NUM_THREADS) gets its share, so OpenMP threads never outnumber cores.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, _share))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``tiny_model_factory(arch, **overrides) -> path``; cached per (arch, overrides)."""
    from trillm.testing.tiny_models import build_tiny_model

    cache: dict[tuple, str] = {}

    def make(arch: str, **overrides) -> str:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = str(build_tiny_model(arch, path, **overrides))
        return cache[key]

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module of tiny tensors: OpenMP fan-out costs more than it
    saves there (and stalls on a busy machine). Use with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Folders whose modules start engines in this process (``LLM``, ``AsyncLLM``, executors): their
# ranks, one or several, are forked from this worker's rank zygote server (tests/support/
# rank_servers.py) instead of each start spawning a worker that imports torch again (~2 s of
# CPU each). tests/parallel does the same in its own conftest. A module here that starts a
# Python of its own with this environment drops TRILLM_RANK_ZYGOTE from it (the server is
# not that process's descendant, so its engines would be refused).
# A module elsewhere asks for it by name: pytest.mark.usefixtures("ranks_from_one_zygote").
RANKS_FROM_ONE_ZYGOTE = {
    "core", "engine", "kv_transfer", "lora", "models", "sample", "spec_decode",
    "structured_output", "worker",
}  # fmt: skip


@pytest.fixture(scope="module")
def ranks_from_one_zygote():
    from rank_servers import ranks_from_one_zygote as from_one_zygote

    with from_one_zygote():
        yield


@pytest.fixture(scope="module", autouse=True)
def _ranks_from_one_zygote(request):
    if request.path.parent.name in RANKS_FROM_ONE_ZYGOTE:
        request.getfixturevalue("ranks_from_one_zygote")


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """``shared_server(args) -> ServerProcess``: one ``trillm serve ARGS`` per distinct flags for
    the whole session of this worker (tests/support/shared_servers.py says which modules may)."""
    from shared_servers import ServerPool

    pool = ServerPool(tmp_path_factory.mktemp("shared-servers"))
    yield pool.get
    failures = pool.close()
    assert not failures, "\n".join(failures)


@pytest.fixture(autouse=True)
def _close_open_requests():
    """The raw client sockets a test left open (server_harness.open_request) closed after it."""
    yield
    harness = sys.modules.get("server_harness")
    if harness is not None:
        harness.close_open_requests()


@pytest.fixture(scope="session")
def tok():
    """The embedded default model's tokenizer (real, loaded once)."""
    from transformers import AutoTokenizer

    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


@pytest.fixture
def python_without_extensions():
    """``run(code) -> stdout`` of ``python -c code`` in a fresh process with
    ``TRILLM_NO_EXTENSIONS=1`` (the switch is read once per process); fails on a non-zero exit."""
    import subprocess
    import sys

    def run(code: str) -> str:
        env = {**os.environ, "TRILLM_NO_EXTENSIONS": "1"}
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    return run


# Tiers by folder (see the markers in pyproject.toml): ``-m "not parallel and not fault"`` skips
# the multi-process layouts and the hostile clients; ``-m "not server"`` every module that starts
# a ``trillm serve``. The default command selects everything.
FOLDER_MARKERS = {"native": "native", "parallel": "parallel", "fault": "fault"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        # A file runs on one worker (its module fixtures start once), unless it names the
        # group it shares a server with (tests/support/shared_servers.py).
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(
                pytest.mark.xdist_group(item.path.relative_to(config.rootpath).as_posix())
            )
        folder = item.path.parent.name
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
        module = getattr(item, "module", None)
        starts_one = module is not None and hasattr(module, "ServerProcess")
        if starts_one or "shared_server" in getattr(item, "fixturenames", ()):
            item.add_marker("server")
    items[:] = longest_groups_first(items)


def item_group(item) -> str:
    """The xdist group of a test, named as pytest-xdist names its work unit."""
    names = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
    return "_".join(names)


def longest_groups_first(items):
    """The tests, their groups ordered by recorded duration, longest first (stable within a
    group). pytest-xdist hands groups out in collection order (``--no-loadscope-reorder``), so
    the long groups start while others are still queued and no long group is left for the end,
    when the other workers would wait idle (the longest-processing-time-first rule). A group
    without a recorded duration (a new file) goes first: starting it early never lengthens the
    tail, ending with it might."""
    from group_durations import load_durations

    seconds = load_durations()
    order = {}
    for item in items:
        order.setdefault(item_group(item), len(order))
    unknown = float("inf")
    return sorted(
        items,
        key=lambda item: (-seconds.get(item_group(item), unknown), order[item_group(item)]),
    )


def pytest_configure(config):
    """``TRILLM_RECORD_GROUP_DURATIONS=PATH``: the controller writes each group's total time
    (setup + call + teardown of its tests) to PATH at the end (tests/support/group_durations.py)."""
    import group_durations

    path = os.environ.get("TRILLM_RECORD_GROUP_DURATIONS")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(group_durations.Recorder(path), "group-durations-recorder")
