"""The Ray executor (``distributed_executor_backend="ray"``): TP=2, PP=2 and TP x PP over
Ray actors give one in-process rank's greedy tokens and log-probs; a killed actor ends the
engine with an error naming its rank; no actor outlives the engine; without Ray the backend
is refused at load naming the extra.

One local Ray cluster serves the whole module (``ray_cluster``, tests/parallel/conftest.py).
Skipped where Ray is not installed (``pip install 'trillm[ray]'``: ~240 MB, not in
the test extra).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from parallel_reference import (
    LIMITS,
    PROMPTS,
    SHARDED_LLAMA,
    greedy,
    http_greedy_tokens,
    limit_flags,
)
from ray_marks import RAY_TESTS
from server_harness import ServerProcess
from worker_processes import pid_alive

from trillm.engine.llm import LLM
from trillm.errors import EngineDeadError

pytestmark = RAY_TESTS

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama", **SHARDED_LLAMA)


def _tokens_and_logprobs(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    params = greedy()
    params.logprobs = 0
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = []
    for out in outs:
        comp = out.outputs[0]
        logprobs.append([lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)])
    return tokens, logprobs


@pytest.fixture(scope="module")
def reference(llama):
    with LLM(llama, distributed_executor_backend="uni", **LIMITS) as llm:
        return _tokens_and_logprobs(llm)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_ranks_as_ray_actors_equal_one_rank(llama, reference, ray_cluster, tp, pp):
    """TP, PP and TP x PP over Ray actors: greedy tokens equal, log-probs within 1e-4 of one
    in-process rank; every actor is gone once the engine has stopped."""
    with LLM(
        llama,
        distributed_executor_backend="ray",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **LIMITS,
    ) as llm:
        pids = list(llm.engine.executors[0].worker_pids)
        assert len(pids) == tp * pp and all(pid_alive(p) for p in pids)
        tokens, logprobs = _tokens_and_logprobs(llm)
    ref_tokens, ref_logprobs = reference
    assert tokens == ref_tokens
    diff = max(abs(a - b) for got, ref in zip(logprobs, ref_logprobs) for a, b in zip(got, ref))
    assert diff < LOGPROB_TOL, diff
    assert not any(pid_alive(p) for p in pids)


def test_a_killed_actor_ends_the_engine_naming_its_rank(llama, ray_cluster):
    """Rank 1's actor killed between requests: the next generate raises EngineDeadError
    naming rank 1, and rank 0's actor is gone too once the engine has stopped."""
    llm = LLM(llama, distributed_executor_backend="ray", tensor_parallel_size=2, **LIMITS)
    try:
        pids = list(llm.engine.executors[0].worker_pids)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"Worker rank 1 \(Ray actor"):
            for _ in range(50):  # until the liveness probe has seen it
                llm.generate(PROMPTS[:1], greedy(2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not any(pid_alive(p) for p in pids)


def _rank_actor_pids() -> list[int]:
    """The processes running a rank actor on this machine (Ray titles them ray::RankActor)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(
                b"ray::RankActor"
            ):
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def test_served_over_http_and_no_actor_left_after_stop(llama, reference, ray_cluster, tmp_path):
    """trillm serve --distributed-executor-backend ray -tp 2: completions give one rank's
    greedy tokens; after SIGTERM the server exits 0 and no rank actor runs."""
    args = [llama, "--distributed-executor-backend", "ray", "-tp", "2", *limit_flags()]
    server = ServerProcess(args, tmp_path / "serve.log").start()
    try:
        assert len(_rank_actor_pids()) == 2, server.log()
        tokens = http_greedy_tokens(server.base_url)
    finally:
        code = server.stop()
    assert tokens == reference[0]
    assert code == 0, server.log()
    assert _rank_actor_pids() == []


def test_without_ray_the_backend_is_refused_naming_the_extra(llama, monkeypatch):
    import importlib.util

    from trillm.config import EngineArgs

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"needs Ray.*trillm\[ray\]"):
        EngineArgs(llama, distributed_executor_backend="ray", tensor_parallel_size=2)


_SIGTERM_AFTER_RAY_INIT = """
import os, signal, sys, threading, time
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
import ray
from trillm.executor.ray_cluster import reclaim_signal_handlers
def init():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
thread = threading.Thread(target=init)  # as the executor does: ray.init off the main thread
thread.start()
thread.join()
reclaim_signal_handlers()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("handled", got, flush=True)
ray.shutdown()
"""


def test_sigterm_after_ray_init_reaches_the_process_own_handler(ray, tmp_path):
    """ray.init installs Ray's C++ failure-signal handler for SIGTERM over the server's own
    (it printed "*** SIGTERM received" and could end a draining server with SIGABRT); the
    executor puts the process's handlers back, so a SIGTERM reaches only its own handler."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _SIGTERM_AFTER_RAY_INIT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "handled [15]" in out, out
    assert "SIGTERM received" not in out, out
