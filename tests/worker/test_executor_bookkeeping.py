"""The bookkeeping both multi-rank executors share (``trillm/executor/bookkeeping.py``): the
batch queue's call order, and the executor's death (first error kept, calls in flight
cancelled, a shutdown no failure). The executors over real processes and actors:
tests/worker/test_executor.py, tests/parallel/test_ray_executor.py."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trillm.errors import EngineDeadError, EngineStartupError
from trillm.executor.bookkeeping import Lifeline, StepQueue, runner_name
from trillm.ipc import codec
from trillm.ipc.control import WorkerCall
from trillm.messages import CachedRequestData, SampleRequest, SchedulerOutput


def _step(step_id: int, wait_for_bitmask: bool = False) -> SchedulerOutput:
    return SchedulerOutput(
        step_id, [], CachedRequestData(), {}, 0, wait_for_bitmask=wait_for_bitmask
    )


def test_steps_go_add_then_sample_then_collect_oldest_first_up_to_the_depth() -> None:
    steps: StepQueue[list[str]] = StepQueue(max_batches=2)
    assert codec.decode(steps.call_frame("ping", [1], {})) == WorkerCall("ping", [1], {})
    with pytest.raises(RuntimeError, match="sample_tokens called without execute_model"):
        steps.start_sampling(None)
    steps.add(_step(1), ["refs 1"])
    with pytest.raises(RuntimeError, match="execute_model called twice"):
        steps.add(_step(2), [])  # the first one's sampling has not started
    with pytest.raises(RuntimeError, match="collect_step called without a step"):
        steps.collect()
    assert steps.start_sampling(None) is None  # no bitmask: nothing to send
    steps.add(_step(2, wait_for_bitmask=True), ["refs 2"])
    assert steps.start_sampling(None) == SampleRequest(2)
    steps.newest.append("sample refs 2")
    with pytest.raises(RuntimeError, match="execute_model called twice"):
        steps.add(_step(3), [])  # two in flight: the queue is full
    assert steps.collect() == (_step(1), ["refs 1"])
    with pytest.raises(RuntimeError, match="collective_rpc called with steps in flight"):
        steps.call_frame("ping", [], {})
    assert steps.collect() == (_step(2, True), ["refs 2", "sample refs 2"])
    steps.call_frame("ping", [], {})  # between steps again


def test_a_step_that_waits_for_a_bitmask_gets_the_request_or_an_empty_one() -> None:
    steps: StepQueue[None] = StepQueue(max_batches=1)
    steps.add(_step(5, wait_for_bitmask=True), None)
    assert steps.start_sampling(None) == SampleRequest(5)
    steps.collect()
    given = SampleRequest(6, {"r": b"\x01\x00\x00\x00"})
    steps.add(_step(6, wait_for_bitmask=True), None)
    assert steps.start_sampling(given) is given
    steps.collect()
    steps.add(_step(7), None)
    with pytest.raises(ValueError, match="without wait_for_bitmask"):
        steps.start_sampling(SampleRequest(7))


def test_the_ranks_take_the_runner_by_name_only() -> None:
    assert runner_name("pkg.mod:Runner", "RayExecutor", "the rank actors") == "pkg.mod:Runner"
    with pytest.raises(TypeError, match=r"^RayExecutor needs the runner as a 'package.module:C"):
        runner_name(object, "RayExecutor", "the rank actors")


def test_the_first_death_is_kept_and_raised_as_a_fresh_copy() -> None:
    life = Lifeline()
    with pytest.raises(EngineDeadError, match="has not been started"):
        life.check(started=False)
    life.check(started=True)
    assert life.fail(EngineStartupError("rank 1 died"))
    assert not life.fail(EngineDeadError("rank 0 died"))  # the first error stays
    assert not life.shut_down()
    first, second = life.death(), life.death()
    assert type(first) is EngineStartupError and str(first) == "rank 1 died"
    assert first is not second
    with pytest.raises(EngineStartupError, match="rank 1 died"):
        life.check(started=True)


def test_a_death_cancels_the_calls_in_flight_and_only_a_failure_sets_failed() -> None:
    async def main() -> None:
        life = Lifeline()
        ended = []

        async def call() -> None:
            with life.call(limit_s=None):
                await trio.sleep_forever()
            ended.append("cancelled by the death")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            assert life.fail(EngineDeadError("rank 1 died"))
        assert ended == ["cancelled by the death"]
        assert isinstance(await life.wait_failed(), EngineDeadError)

        stopped = Lifeline()
        assert stopped.shut_down() and not stopped.failed.is_set()
        assert "shut down" in str(stopped.death())

    trio.run(main)


def test_a_call_past_its_limit_raises_too_slow() -> None:
    async def main() -> None:
        with pytest.raises(trio.TooSlowError):
            with Lifeline().call(limit_s=0.01):
                await trio.sleep_forever()

    trio.run(main)
