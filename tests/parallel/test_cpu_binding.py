"""vLLM's CPU thread binding (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``):
each rank's threads pinned to its cores, one torch / native thread per core, observed inside
real rank processes (TP=2 bound "0|1" on this 2-core machine); auto's split; every value that
cannot be honoured stops the start naming its variable."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch
from parallel_reference import (
    LIMITS,
    SHARDED_LLAMA,
    greedy,
    http_greedy_tokens,
    reference_tokens,
)
from server_harness import ServerProcess
from worker_processes import worker_ranks

from trillm import envs
from trillm.config import ParallelConfig
from trillm.distributed.cpu_binding import RankCores, bind_rank, split_cores
from trillm.engine.llm import LLM
from trillm.entrypoints.cli.collect_env import collect

BIND, RESERVED = "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"


def every_cpu(cpus):
    return list(cpus)


def thread_affinities(pid: int) -> set[str]:
    """The Cpus_allowed_list of every thread of ``pid``."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        found.add(re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M).group(1))
    return found


# ---------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("auto", "auto"),
        (" nobind ", "nobind"),
        ("", None),
        ("0-31|32-63", (tuple(range(32)), tuple(range(32, 64)))),
        ("0,2|1,3", ((0, 2), (1, 3))),
        ("4-5,0", ((4, 5, 0),)),
    ],
)
def test_vllms_values_are_read(monkeypatch, text, value):
    monkeypatch.setenv(BIND, text)
    assert envs.CPU_OMP_THREADS_BIND.get() == value


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (BIND, "0-|1", "'0-' is not a core id"),
        (BIND, "0||1", "'' is not a core id"),
        (BIND, "3-1", "'3-1' is not a core id"),
        (BIND, "0,0|1", "'0,0' names a core twice"),
        (BIND, "all", "'all' is not a core id"),
        (RESERVED, "-1", "must be a whole number >= 0"),
    ],
)
def test_malformed_values_are_refused_naming_the_variable(monkeypatch, name, text, message):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=f"^{name}.*{re.escape(message)}"):
        envs.check_all()


# ---------------------------------------------------------------- the split


def test_auto_splits_the_usable_cores_less_the_reserved_ones():
    eight = list(range(8))
    assert split_cores("auto", None, 1, eight, every_cpu) == [tuple(range(8))]
    # several ranks: vLLM's default leaves one core (the last) to the server and engine core
    assert split_cores("auto", None, 3, eight, every_cpu) == [(0, 1, 2), (3, 4), (5, 6)]
    assert split_cores("auto", 0, 2, eight, every_cpu) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert split_cores("auto", 2, 2, [2, 3, 5, 7], every_cpu) == [(2,), (3,)]
    # the reserved count alone asks for auto (vLLM's default binding)
    assert split_cores(None, 4, 2, eight, every_cpu) == [(0, 1), (2, 3)]


def test_auto_takes_one_logical_cpu_per_physical_core():
    def first_sibling(cpus):  # cpus 0-3 and 4-7 are hyperthreads of the same 4 cores
        return [c for c in cpus if c < 4]

    assert split_cores("auto", 0, 2, list(range(8)), first_sibling) == [(0, 1), (2, 3)]


def test_nobind_and_unset_pin_nothing():
    assert split_cores("nobind", None, 2, [0, 1], every_cpu) is None
    assert split_cores(None, None, 2, [0, 1], every_cpu) is None


@pytest.mark.parametrize(
    ("bind", "reserved", "message"),
    [
        ("0", None, f"{BIND} gives 1 core lists (0) but this node runs 2 ranks"),
        ("0|1|0", None, f"{BIND} gives 3 core lists (0|1|0) but this node runs 2 ranks"),
        ("0|7", None, f"{BIND}: cores 7 are not among this process's usable cores (0-1)"),
        ("0|1", "0", f"{RESERVED}=0 applies to {BIND}=auto only ({BIND} is 0|1)"),
        ("nobind", "1", f"{RESERVED}=1 applies to {BIND}=auto only"),
        ("auto", None, f"{BIND}=auto: 2 usable cores less 1 reserved ({RESERVED}) leave 1"),
        (None, "2", f"{BIND}=auto: 2 usable cores less 2 reserved"),
    ],
)
def test_what_cannot_be_honoured_stops_the_load(llama, monkeypatch, bind, reserved, message):
    """Checked when the engine's configuration is built, before any rank starts."""
    for name, text in ((BIND, bind), (RESERVED, reserved)):
        if text is not None:
            monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(llama, tensor_parallel_size=2, **LIMITS)


@pytest.mark.parametrize(("omp", "threads"), [("3", 3), ("3,1", 3), (None, None)])
def test_nobind_gives_omp_num_threads_even_past_the_cores(monkeypatch, capfd, omp, threads):
    """As OpenMP reads it (torch's own reading caps it at the cores); unset: torch's default
    for a rank alone. Nothing pinned."""
    before = torch.get_num_threads()
    monkeypatch.setenv(BIND, "nobind")
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        got = bind_rank(ParallelConfig(), 0)
    finally:
        torch.set_num_threads(before)
    assert got == RankCores(None, threads or before)
    assert f"not pinned; threads: {threads or before} " in capfd.readouterr().err


def test_collect_env_shows_each_ranks_cores(monkeypatch):
    monkeypatch.setenv(BIND, "0|1")
    assert dict(collect())["CPU threads binding"] == "0|1: 2 ranks: 0 | 1 (one thread per core)"
    monkeypatch.setenv(BIND, "auto")
    assert dict(collect())["CPU threads binding"].startswith("auto: 1 rank: 0-1; 2 ranks: ")


# ---------------------------------------------------------------- real ranks


@pytest.fixture(scope="module")
def llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama", **SHARDED_LLAMA)


@pytest.fixture(scope="module")
def tp1_tokens(llama) -> list[list[int]]:
    return reference_tokens(llama)  # before the module's server sets the variable


@pytest.fixture(scope="module")
def bound_server(llama, tp1_tokens, tmp_path_factory):
    log = tmp_path_factory.mktemp("cpu-binding") / "server.log"
    args = [llama, "--tensor-parallel-size", "2", "--max-model-len", "256"]
    srv = ServerProcess([*args, "--kv-cache-memory", "16MiB"], log)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BIND, "0|1")
        srv.start()
    yield srv
    srv.stop()


def test_each_rank_runs_one_thread_per_core_on_its_own_core(bound_server, tp1_tokens):
    """Every thread of rank r, those started before the pinning and those the model's first
    steps started (torch's and the native pool's), runs on core r alone; each rank says so at
    start; the tokens are TP=1's."""
    ranks = worker_ranks(bound_server.proc.pid)
    assert sorted(ranks) == [0, 1]
    assert http_greedy_tokens(bound_server.base_url) == tp1_tokens
    for rank, pid in ranks.items():
        assert thread_affinities(pid) == {str(rank)}, rank
        line = (
            f"rank {rank} (pid {pid}): cores {rank}; threads: 1 (torch's and the native kernels')"
        )
        assert line in bound_server.log_path.read_text(), bound_server.log()
    assert httpx.get(bound_server.url + "/health").status_code == 200


def test_serve_refuses_a_malformed_value_at_start(tmp_path, monkeypatch, llama):
    monkeypatch.setenv(BIND, "0-|1")
    srv = ServerProcess([llama], tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="exited with 2"):
        srv.start()
    assert f"{BIND}: '0-' is not a core id or a range like 0-3." in srv.log()


def test_a_rank_alone_is_bound_too(llama, monkeypatch, capfd):
    """One rank (no tensor parallelism) in its worker process: pinned to core 1, one thread."""
    monkeypatch.setenv(BIND, "1")
    with LLM(llama, **LIMITS) as llm:
        line = re.search(r"rank 0 \(pid (\d+)\): (.*)", capfd.readouterr().err)
        assert line and line.group(2) == "cores 1; threads: 1 (torch's and the native kernels')"
        assert thread_affinities(int(line.group(1))) == {"1"}
        assert llm.generate(["Hello"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids
