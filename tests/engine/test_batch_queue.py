"""The engine core's batch queue (pipeline parallelism, issue 14) over both scheduler twins, with
a stub executor that runs each step when it is sent (as stage 0 does) and answers the oldest
when collected: up to M steps in flight over disjoint requests, outputs applied in step order,
each request's tokens sent to the other stages with the next step, and a request aborted in
flight whose id a new request takes never gets the old request's token. The real pipeline
(two worker processes, HTTP, preemption) is tests/parallel/test_pipeline_parallel.py."""

from __future__ import annotations

from collections import deque

import pytest
import trio
from grammar_manager import grammar_manager
from scheduler_twin_helpers import (
    IMPL_NAMES,
    FakeWorker,
    InProcessStubExecutor,
    ecr,
    get_impl,
    make_scheduler,
)

from trillm.engine.core import EngineCore
from trillm.messages import AbortRequests, ModelRunnerOutput, SchedulerOutput


class StubPipelineExecutor(InProcessStubExecutor):
    """Two pipeline stages, ``depth`` steps in flight; a FakeWorker computes each step."""

    def __init__(self, worker: FakeWorker, depth: int = 2) -> None:
        self.worker = worker
        self.depth = depth
        self.sent: list[SchedulerOutput] = []
        self.in_flight: deque[ModelRunnerOutput] = deque()

    async def execute_model(self, sched: SchedulerOutput) -> None:
        assert len(self.in_flight) < self.depth
        # An id the step finishes and sends anew is a new request (an abort, then its id again).
        busy = {r for out in self.in_flight for r in out.req_ids} - set(sched.finished_req_ids)
        assert not busy & set(sched.num_scheduled_tokens), "a request in two steps in flight"
        self.sent.append(sched)
        self.in_flight.append(self.worker.execute(sched))

    async def start_sampling(self, req) -> None:
        assert req is None

    async def collect_step(self) -> ModelRunnerOutput:
        return self.in_flight.popleft()

    @property
    def num_pipeline_stages(self) -> int:
        return 2

    @property
    def max_concurrent_batches(self) -> int:
        return self.depth

    async def sample_tokens(self, req) -> ModelRunnerOutput:
        raise AssertionError("a pipeline step is sampled through start_sampling / collect_step")


def scripted_worker(scripts: dict[str, list[int]]) -> FakeWorker:
    cursors = {k: iter(v) for k, v in scripts.items()}
    return FakeWorker(token_fn=lambda req_id: next(cursors[req_id]))


def run(core: EngineCore, outputs: dict[str, list[int]], max_steps: int = 200) -> None:
    async def loop() -> None:
        for _ in range(max_steps):
            if not (core.scheduler.has_unfinished_requests() or core.num_in_flight):
                return
            result = await core.step()
            for out in result.outputs if result is not None else ():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        raise AssertionError("requests did not finish")

    trio.run(loop)


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_two_steps_in_flight_over_disjoint_requests(impl_name):
    scripts = {name: [10 * i + k for k in range(5)] for i, name in enumerate("abcd")}
    sched = make_scheduler(get_impl(impl_name))
    executor = StubPipelineExecutor(scripted_worker(scripts))
    core = EngineCore(sched, executor, grammar_manager())
    for i, name in enumerate(scripts):
        core.handle_input(ecr(name, [i + 1] * 3, max_tokens=5, arrival=i))
    outputs: dict[str, list[int]] = {}
    run(core, outputs)
    assert outputs == scripts
    assert core.batch_queue.depths[2] > 0 and set(core.batch_queue.depths) == {1, 2}
    # Each step carries its share (2 of 4) and, for the other stages, exactly the tokens
    # applied since the step before it was sent.
    assert [sorted(s.num_scheduled_tokens) for s in executor.sent[:2]] == [["a", "b"], ["c", "d"]]
    carried: dict[str, list[int]] = {}
    for s in executor.sent:
        for req_id, tokens in s.pp_sampled_token_ids.items():
            carried.setdefault(req_id, []).extend(tokens)
    assert all(carried[r] == scripts[r][: len(carried[r])] for r in carried)
    assert all(len(carried[r]) >= 3 for r in scripts)  # the last ones need no further step


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_id_reused_after_an_abort_in_flight_gets_only_its_own_tokens(impl_name):
    """``a`` is aborted while its step is in flight and a new ``a`` arrives before that step's
    output: the output (999) is the old request's, so the new one never sees it."""
    sched = make_scheduler(get_impl(impl_name))
    worker = scripted_worker({"a": [999, 1, 2, 3], "b": [7, 8, 9]})
    executor = StubPipelineExecutor(worker)
    core = EngineCore(sched, executor, grammar_manager())
    core.handle_input(ecr("a", [1, 2, 3], max_tokens=3))
    outputs: dict[str, list[int]] = {}

    async def first_step() -> None:
        assert await core.step() is None  # sent; the queue is not full
        assert core.num_in_flight == 1

    trio.run(first_step)
    core.handle_input(AbortRequests(["a"]))
    core.handle_input(ecr("a", [4, 5, 6], max_tokens=3))
    core.handle_input(ecr("b", [7, 8], max_tokens=3))
    run(core, outputs)
    assert outputs == {"a": [1, 2, 3], "b": [7, 8, 9]}
    second = executor.sent[1]
    assert second.finished_req_ids == ["a"]  # the old a, dropped before the new one is added
    assert [(n.req_id, n.prompt_token_ids) for n in second.scheduled_new_reqs] == [("a", [4, 5, 6])]
    assert all(999 not in s.pp_sampled_token_ids.get("a", []) for s in executor.sent)
