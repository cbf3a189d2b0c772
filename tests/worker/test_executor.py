"""Executors with the fake runner: real worker subprocesses, real shared memory, real kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import trio
from rank_servers import ranks_from_one_zygote
from scheduler_driver import Driver
from worker_processes import pid_alive, shm_exists

from trillm.errors import EngineDeadError, EngineStartupError, ModelExecutionError
from trillm.executor.abstract import FAKE_RUNNER
from trillm.executor.factory import open_executor
from trillm.executor.multiproc import MultiprocExecutor
from trillm.executor.uniproc import UniProcExecutor
from trillm.executor.worker_ipc import WORKER_GOMP_SPINCOUNT, worker_env
from trillm.messages import (
    ModelRunnerOutput,
    SampleRequest,
)
from trillm.utils import unwrap_group
from trillm.worker.fake_runner import FakeModelRunner, make_fake_config

ROOT = Path(__file__).resolve().parents[2]
VOCAB, EOS = 4096, (2, 0)


@pytest.fixture(scope="module", autouse=True)
def _ranks_from_one_zygote():
    """The multi-rank executors here fork their ranks from this worker's rank zygote server
    (tests/support/rank_servers.py), not from a fresh zygote each."""
    with ranks_from_one_zygote():
        yield


def expected_token(req_id: str, position: int) -> int:
    """The fake model's rule, written out independently of fake_runner.py."""
    token = zlib.crc32(f"{req_id}:{position}".encode()) % VOCAB
    while token in EOS:
        token = (token + 1) % VOCAB
    return token


async def drive(executor, steps: int, prompt_lens=None) -> Driver:
    driver = Driver(prompt_lens or {"a": 5, "b": 20})
    for _ in range(steps):
        sched = driver.step()
        await executor.execute_model(sched)
        driver.update(sched, await executor.sample_tokens(None))
    return driver


def check_outputs(driver: Driver, steps: int) -> None:
    # "a" (5 tokens) samples from step 1, "b" (20 tokens, chunks of 8) from step 3.
    for r, first_step in (("a", 1), ("b", 3)):
        plen = driver.prompt_lens[r]
        want = [expected_token(r, plen + i) for i in range(steps - first_step + 1)]
        assert driver.outputs[r] == want


def run(fn, *args):
    return trio.run(fn, *args)


def test_worker_env_shortens_the_openmp_spin_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = worker_env()
    assert env["GOMP_SPINCOUNT"] == WORKER_GOMP_SPINCOUNT
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("GOMP_SPINCOUNT", "infinite")
    assert worker_env()["GOMP_SPINCOUNT"] == "infinite"


# ---------------------------------------------------------------- in-process runner


def test_fake_runner_in_process_matches_the_rule():
    runner = FakeModelRunner(make_fake_config(num_blocks=64))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    driver = Driver({"a": 5, "b": 20})
    for _ in range(6):
        sched = driver.step()
        runner.execute_model(sched)
        out = runner.sample_tokens(None)
        driver.update(sched, out)
    check_outputs(driver, 6)
    assert out.logprobs["b"].token_ids[0][0] == driver.outputs["b"][-1]


def test_uniproc_executor_runs_steps():
    async def main():
        config = make_fake_config(num_blocks=64, backend="uni")
        with trio.fail_after(30):
            async with open_executor(config, FAKE_RUNNER) as ex:
                assert isinstance(ex, UniProcExecutor)
                assert ex.num_blocks == 64 == config.cache.num_blocks
                check_outputs(await drive(ex, 6), 6)
                ex.check_health()
        with pytest.raises(EngineDeadError, match="shut down"):
            ex.check_health()

    run(main)


def test_uniproc_step_error_is_a_model_execution_error():
    async def main():
        config = make_fake_config(backend="uni")
        async with open_executor(config, FakeModelRunner, {"fail_on_step": 2}) as ex:
            driver = Driver({"a": 5})
            sched = driver.step()
            await ex.execute_model(sched)
            driver.update(sched, await ex.sample_tokens(None))
            await ex.execute_model(driver.step())
            with pytest.raises(ModelExecutionError, match="told to fail at step 2") as info:
                await ex.sample_tokens(None)
            assert info.value.step_id == 2

    run(main)


# ---------------------------------------------------------------- worker processes


@pytest.mark.parametrize("tp", [1, 2])
def test_multiproc_executor_runs_steps_and_shuts_down_cleanly(tp):
    async def main():
        config = make_fake_config(num_blocks=64, tensor_parallel_size=tp)
        with trio.fail_after(120):
            async with open_executor(config, FAKE_RUNNER) as ex:
                assert isinstance(ex, MultiprocExecutor)
                assert ex.num_blocks == 64 == config.cache.num_blocks
                names, procs = ex.segment_names, list(ex.processes)
                assert len(procs) == tp and all(shm_exists(n) for n in names)
                check_outputs(await drive(ex, 8), 8)
        return names, procs, ex

    names, procs, ex = run(main)
    assert [p.returncode for p in procs] == [0] * tp  # exited on Shutdown, not killed
    assert not any(pid_alive(p.pid) for p in procs)
    assert not any(shm_exists(n) for n in names)
    with pytest.raises(EngineDeadError, match="shut down"):
        ex.check_health()


def test_multiproc_large_messages_and_bitmask_round_trip():
    # Small slots force every step to be split over several chunks; a bitmask that allows
    # only tokens 5 and 7 goes through a SampleRequest.
    async def main():
        config = make_fake_config(num_blocks=64)
        async with open_executor(config, FAKE_RUNNER, num_slots=2, slot_size=64) as ex:
            driver = Driver({"a": 5, "b": 3})
            sched = driver.step(wait_for_bitmask=True)
            await ex.execute_model(sched)
            words = [0] * (VOCAB // 32)
            words[0] = (1 << 5) | (1 << 7)
            out = await ex.sample_tokens(SampleRequest(sched.step_id, {"a": words, "b": words}))
            assert all(t[0] in (5, 7) for t in out.sampled_token_ids)
            driver.update(sched, out)
            sched = driver.step(wait_for_bitmask=True)
            await ex.execute_model(sched)
            out = await ex.sample_tokens(None)  # no mask this time
            assert out.sampled_token_ids == [[expected_token("a", 6)], [expected_token("b", 4)]]

    run(main)


def test_worker_step_error_surfaces_and_the_worker_survives():
    async def main():
        config = make_fake_config()
        async with open_executor(config, FAKE_RUNNER, {"fail_on_step": 2}) as ex:
            driver = Driver({"a": 5})
            sched = driver.step()
            await ex.execute_model(sched)
            driver.update(sched, await ex.sample_tokens(None))
            await ex.execute_model(driver.step())
            with pytest.raises(ModelExecutionError, match="rank 0") as info:
                await ex.sample_tokens(None)
            assert "told to fail at step 2" in str(info.value)
            assert info.value.output.req_ids == ["a"]
            ex.check_health()
            sched = driver.step()  # the engine would finish "a"; the worker still answers
            await ex.execute_model(sched)
            assert (await ex.sample_tokens(None)).step_id == 3

    run(main)


@pytest.mark.parametrize(
    ("runner", "kwargs", "detail"),
    [
        (FAKE_RUNNER, {"fail_on_load": True}, "told to fail in load_model"),
        ("trillm.worker.fake_runner:NoSuchRunner", {}, "NoSuchRunner"),
    ],
)
def test_startup_failure_raises_with_the_worker_traceback(runner, kwargs, detail):
    executor = MultiprocExecutor(make_fake_config(), runner, kwargs)

    async def main():
        with trio.fail_after(60):
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(executor.run)
            except BaseExceptionGroup as group:
                raise unwrap_group(group) from None

    with pytest.raises(EngineStartupError, match="Worker rank 0 failed to start") as info:
        run(main)
    assert detail in str(info.value)
    assert len(executor.segment_names) == 2
    assert not any(shm_exists(n) for n in executor.segment_names)
    assert not any(pid_alive(pid) for pid in executor.worker_pids)


def test_killed_worker_fails_inflight_and_later_calls():
    async def main():
        config = make_fake_config(tensor_parallel_size=2)
        async with open_executor(config, FAKE_RUNNER, {"step_sleep_s": 5.0}) as ex:
            names, victim = ex.segment_names, ex.processes[1]
            await ex.execute_model(Driver({"a": 5}).step())
            start = time.monotonic()
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:

                    async def kill_soon() -> None:
                        await trio.sleep(0.3)  # sample_tokens is waiting, workers are mid-step
                        os.kill(victim.pid, signal.SIGKILL)

                    nursery.start_soon(kill_soon)
                    with pytest.raises(EngineDeadError) as info:
                        await ex.sample_tokens(None)
            assert time.monotonic() - start < 5.0  # not the end of the step
            message = str(info.value)
            assert "Worker rank 1" in message and "SIGKILL" in message
            assert not any(shm_exists(n) for n in names)  # unlinked at once
            with pytest.raises(EngineDeadError, match="rank 1"):
                ex.check_health()
            with pytest.raises(EngineDeadError, match="rank 1"):
                await ex.execute_model(Driver({"c": 1}).step())
            procs = list(ex.processes)
        return procs

    procs = run(main)
    assert procs[1].returncode == -signal.SIGKILL
    assert not any(pid_alive(p.pid) for p in procs)


PARENT = textwrap.dedent(
    """
    import json, sys, trio
    from trillm.executor.abstract import FAKE_RUNNER
    from trillm.utils import unwrap_group
    from trillm.executor.factory import open_executor
    from trillm.worker.fake_runner import make_fake_config

    async def main():
        async with open_executor(make_fake_config(tensor_parallel_size=2), FAKE_RUNNER) as ex:
            info = {"pids": ex.worker_pids, "segments": ex.segment_names}
            print(json.dumps(info), flush=True)
            await trio.sleep(600)

    trio.run(main)
    """
)


def test_workers_exit_when_the_parent_is_killed():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRILLM_RANK_ZYGOTE")  # this process's server: the parent starts its own zygote
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        info = json.loads(parent.stdout.readline())
        assert all(pid_alive(pid) for pid in info["pids"])
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in info["pids"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(pid) for pid in info["pids"])
    # The creator's resource tracker unlinks the segments once the parent is gone.
    while any(shm_exists(n) for n in info["segments"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(shm_exists(n) for n in info["segments"])


def test_hung_worker_is_declared_dead_after_the_step_timeout():
    async def main():
        config = make_fake_config()
        async with open_executor(config, FAKE_RUNNER, step_timeout_s=1.0) as ex:
            names, proc = ex.segment_names, ex.processes[0]
            os.kill(proc.pid, signal.SIGSTOP)  # alive but silent
            await ex.execute_model(Driver({"a": 5}).step())
            with trio.fail_after(10):
                with pytest.raises(EngineDeadError, match="did not answer step 1 within 1.0 s"):
                    await ex.sample_tokens(None)
            assert not any(shm_exists(n) for n in names)
        return proc

    proc = run(main)
    assert proc.returncode == -signal.SIGKILL
    assert not pid_alive(proc.pid)


def test_cancelled_sample_tokens_does_not_desync_the_next_step():
    async def main():
        config = make_fake_config(tensor_parallel_size=2)
        async with open_executor(config, FAKE_RUNNER, {"step_sleep_s": 0.3}) as ex:
            driver = Driver({"a": 5})
            sched = driver.step()
            await ex.execute_model(sched)
            with trio.move_on_after(0.05) as scope:
                await ex.sample_tokens(None)  # the caller gives up on step 1
            assert scope.cancelled_caught
            ex.check_health()
            # What step 1 produced (the worker still ran it): keep the driver in step.
            driver.update(sched, ModelRunnerOutput(1, ["a"], [[expected_token("a", 5)]]))
            sched = driver.step()
            await ex.execute_model(sched)
            with trio.fail_after(20):
                out = await ex.sample_tokens(None)
            assert out.step_id == 2
            assert out.sampled_token_ids == [[expected_token("a", 6)]]

    run(main)


def test_a_call_after_a_cancelled_sample_tokens_gets_its_own_answer():
    """A step whose output its caller gave up on, then a collective_rpc (an engine core stopped
    mid-step still sends the dummy forwards of -dp N -ep: engine/dp_lockstep.py): the call's
    answer is read past that step's output on each rank's ring, the executor lives on."""

    async def main():
        config = make_fake_config(num_blocks=64, tensor_parallel_size=2)
        async with open_executor(config, FAKE_RUNNER, {"step_sleep_s": 0.3}) as ex:
            await ex.execute_model(Driver({"a": 5}).step())
            with trio.move_on_after(0.05) as scope:
                await ex.sample_tokens(None)  # the caller gives up on step 1
            assert scope.cancelled_caught
            with trio.fail_after(20):
                assert await ex.collective_rpc("determine_num_blocks", [], {}) == [64, 64]
            ex.check_health()

    run(main)
