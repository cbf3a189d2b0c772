"""Several ranks forked from one rank zygote (trillm/executor/rank_zygote.py, rank_launch.py):
they end as children of the engine's process with the worker's own command line, the zygote
and the subreaper flag gone, the same tokens as ranks started one process each; a zygote that
fails is a startup error naming it, and a start cancelled (or timed out) while it imports
leaves no process. Killed ranks, a dead parent and the rest of the executor's supervision run
on zygote ranks in tests/worker/test_executor.py and the tensor / pipeline parallel tests.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest
import trio
from parallel_reference import greedy, reference_tokens

from trillm.engine.llm import LLM
from trillm.errors import EngineStartupError
from trillm.executor import rank_launch
from trillm.executor.abstract import FAKE_RUNNER
from trillm.executor.multiproc import MultiprocExecutor
from trillm.executor.worker_ipc import WorkerIpc
from trillm.utils import unwrap_group
from trillm.worker.fake_runner import make_fake_config

PROMPTS = ["Hello there, how", "1 2 3 4 5"]
MAX_TOKENS = 6
LIMITS = {"max_model_len": 64, "kv_cache_memory": "4MiB"}


def _children() -> dict[int, list[bytes]]:
    """pid -> command line of every child of this process that runs trillm (a rank or a
    zygote; a zombie's is empty, so it counts too)."""
    found = {}
    for task in os.listdir("/proc/self/task"):
        try:
            kids = Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:  # a thread that ended meanwhile
            continue
        for child in kids:
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if not argv[0] or any(b"trillm." in a for a in argv):
                found[int(child)] = argv
    return found


def _subreaper() -> int:
    flag = ctypes.c_int(-1)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(rank_launch.PR_GET_CHILD_SUBREAPER, ctypes.pointer(flag), 0, 0, 0) == 0
    return flag.value


@pytest.fixture(autouse=True)
def _a_zygote_each_start(monkeypatch):
    """The zygote a start makes of its own is what is tested here: no rank zygote server
    (tests/conftest.py names this worker's for the modules of this folder)."""
    monkeypatch.delenv("TRILLM_RANK_ZYGOTE", raising=False)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen2", num_hidden_layers=2)


@pytest.mark.parametrize("mode", ["zygote", "spawn"])
def test_ranks_are_this_process_children_with_the_worker_command_line(model, mode, monkeypatch):
    monkeypatch.setenv(rank_launch.START_ENV, mode)
    before = set(_children())
    with LLM(model, tensor_parallel_size=2, **LIMITS) as llm:
        kids = {pid: argv for pid, argv in _children().items() if pid not in before}
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
        subreaper_while_serving = _subreaper()
    assert [list(o.outputs[0].token_ids) for o in outs] == reference_tokens(
        model, PROMPTS, MAX_TOKENS, **LIMITS
    )
    # The two ranks and nothing else (the zygote has exited and been reaped).
    assert len(kids) == 2, kids
    ranks = {}
    for argv in kids.values():
        head = [a.decode() for a in argv[:5]]
        assert head[:3] == [sys.executable, "-m", "trillm.worker.worker_main"], argv
        assert head[3] == "--rank", argv
        assert argv[argv.index(b"--parent-pid") + 1] == str(os.getpid()).encode()
        ranks[int(head[4])] = argv
    assert sorted(ranks) == [0, 1]
    assert subreaper_while_serving == 0  # only while the zygote runs
    assert set(_children()) <= before  # both ranks reaped at close


def test_a_zygote_that_fails_is_a_startup_error_that_leaves_nothing(model, monkeypatch):
    monkeypatch.setattr(rank_launch, "ZYGOTE_MODULE", "trillm.executor.no_such_zygote")
    before = set(_children())
    with pytest.raises(
        EngineStartupError,
        match=r"rank zygote \(pid \d+\) exited with code 1 "
        r"after starting 0 of 2 ranks",
    ):
        LLM(model, tensor_parallel_size=2, **LIMITS)
    assert set(_children()) <= before
    assert _subreaper() == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_an_unknown_start_mode_is_refused(model, monkeypatch, tp):
    monkeypatch.setenv(rank_launch.START_ENV, "fork")
    with pytest.raises(
        ValueError, match="TRILLM_WORKER_START='fork': expected one of zygote, spawn"
    ):
        LLM(model, tensor_parallel_size=tp, **LIMITS)


@pytest.mark.parametrize("after_s", [0.2, 1.0])
def test_a_start_cancelled_while_the_zygote_imports_leaves_no_process(after_s):
    before = set(_children())

    async def start() -> float:
        ipc = WorkerIpc(2, 4, 1 << 16)
        began = trio.current_time()
        try:
            with trio.move_on_after(after_s) as scope:
                procs = await rank_launch.start_ranks([ipc.worker_args(r) for r in range(2)])
                for proc in procs:  # not expected: the zygote imports for longer than after_s
                    proc.kill()
                    await proc.wait()
        finally:
            ipc.close()
        assert scope.cancelled_caught
        return trio.current_time() - began

    # The zygote is killed, not left to finish its imports (~3.5 s of CPU) and fork.
    assert trio.run(start) < after_s + 1.5
    assert set(_children()) <= before
    assert _subreaper() == 0


def test_ranks_that_do_not_start_in_time_are_a_startup_error_that_leaves_nothing():
    executor = MultiprocExecutor(
        make_fake_config(tensor_parallel_size=2), FAKE_RUNNER, startup_timeout_s=0.3
    )
    before = set(_children())

    async def main() -> None:
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(executor.run)
        except BaseExceptionGroup as group:
            raise unwrap_group(group) from None

    with pytest.raises(EngineStartupError, match="worker processes did not start within 0.3 s"):
        trio.run(main)
    assert set(_children()) <= before
    assert _subreaper() == 0
