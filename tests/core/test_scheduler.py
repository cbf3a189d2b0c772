"""Scheduler (P1 schedule / P4 update_from_output): one suite for the Python twin and the
native extension."""

from __future__ import annotations

import pytest
from scheduler_twin_helpers import (
    IMPL_NAMES,
    FakeWorker,
    check_scheduler_invariants,
    ecr,
    get_impl,
    make_scheduler,
    step,
)

from trillm import _native
from trillm.core.errors import DuplicateRequestError, RequestTooLargeError
from trillm.core.request import RequestStatus
from trillm.messages import EngineCoreRequest, FinishReason, ModelRunnerOutput
from trillm.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.fixture(params=IMPL_NAMES)
def impl(request):
    return get_impl(request.param)


def prompt(seed: int, n: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def scripted(tokens: dict[str, list[int]]):
    """token_fn for FakeWorker: each request samples its script in order."""
    cursors = {k: iter(v) for k, v in tokens.items()}
    return lambda req_id: next(cursors[req_id])


def run_until_done(sched, worker, max_steps=200):
    outputs, scheds = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return scheds, outputs
        out, outs = step(sched, worker)
        check_scheduler_invariants(sched, worker)
        scheds.append(out)
        outputs.extend(outs)
    raise AssertionError("requests did not finish")


# ---------------------------------------------------------------- budget and batching


def test_token_budget_and_chunked_prefill(impl):
    sched = make_scheduler(impl, max_num_batched_tokens=16)
    for i, name in enumerate("abc"):
        sched.add_request(ecr(name, prompt(i, 10), max_tokens=3, arrival=i))
    worker = FakeWorker()
    out, outs = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}  # b gets a chunk, c nothing
    assert out.total_num_scheduled_tokens == 16
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a", "b"]
    assert [len(n.block_ids) for n in out.scheduled_new_reqs] == [3, 2]
    assert [o.request_id for o in outs] == ["a"]  # b's chunk does not reach its end
    assert sched.waiting_req_ids() == ["c"]
    out, outs = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["a", "b"]
    assert cached.num_computed_tokens == [10, 6]
    assert cached.new_block_ids == [[], [sched.kv_cache_manager.get_block_ids("b")[2]]]
    assert sorted(o.request_id for o in outs) == ["a", "b", "c"]
    check_scheduler_invariants(sched, worker)


def test_max_num_seqs(impl):
    sched = make_scheduler(impl, max_num_seqs=2)
    sched.add_request(ecr("a", prompt(0, 5), max_tokens=1, arrival=0))
    sched.add_request(ecr("b", prompt(1, 5), max_tokens=5, arrival=1))
    sched.add_request(ecr("c", prompt(2, 5), max_tokens=5, arrival=2))
    worker = FakeWorker()
    out, outs = step(sched, worker)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [o.finish_reason for o in outs if o.request_id == "a"] == [FinishReason.LENGTH]
    out, _ = step(sched, worker)
    assert out.finished_req_ids == ["a"]
    assert out.num_scheduled_tokens == {"b": 1, "c": 5}
    assert sched.get_request_counts() == (2, 0)


def test_long_prefill_token_threshold(impl):
    sched = make_scheduler(impl, long_prefill_token_threshold=4)
    sched.add_request(ecr("a", prompt(0, 10), max_tokens=2, arrival=0))
    sched.add_request(ecr("b", prompt(1, 3), max_tokens=2, arrival=1))
    worker = FakeWorker()
    sizes = []
    for _ in range(3):
        out, _ = step(sched, worker)
        sizes.append(out.num_scheduled_tokens)
    assert sizes == [{"a": 4, "b": 3}, {"a": 4, "b": 1}, {"a": 2}]


def test_running_requests_come_before_waiting_ones(impl):
    sched = make_scheduler(impl, max_num_batched_tokens=8)
    sched.add_request(ecr("a", prompt(0, 8), max_tokens=4, arrival=0))
    worker = FakeWorker()
    step(sched, worker)
    sched.add_request(ecr("b", prompt(1, 20), max_tokens=4, arrival=1))
    out, _ = step(sched, worker)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]


# ---------------------------------------------------------------- queue order and preemption


@pytest.mark.parametrize(
    "policy, expected", [("fcfs", ["a", "b", "c"]), ("priority", ["b", "c", "a"])]
)
def test_waiting_order(impl, policy, expected):
    sched = make_scheduler(impl, max_num_seqs=1, policy=policy)
    sched.add_request(ecr("a", prompt(0, 4), max_tokens=1, arrival=0, priority=2))
    sched.add_request(ecr("b", prompt(1, 4), max_tokens=1, arrival=1, priority=0))
    sched.add_request(ecr("c", prompt(2, 4), max_tokens=1, arrival=2, priority=1))
    scheds, _ = run_until_done(sched, FakeWorker())
    assert [n.req_id for s in scheds for n in s.scheduled_new_reqs] == expected


def _two_growing_requests(impl, policy, pa, pb):
    # 4 blocks of 4 slots; each request needs 2 blocks for its prompt and grows into a third.
    sched = make_scheduler(impl, num_blocks=4, block_size=4, policy=policy)
    sched.add_request(ecr("a", prompt(0, 7), max_tokens=8, arrival=0, priority=pa))
    sched.add_request(ecr("b", prompt(1, 7), max_tokens=8, arrival=1, priority=pb))
    worker = FakeWorker()
    for _ in range(2):
        step(sched, worker)
    return sched, worker


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_order(impl, policy):
    # Under priority, a (value 1) is less important than the newer b (value 0).
    sched, worker = _two_growing_requests(impl, policy, pa=1, pb=0)
    assert sched.kv_cache_manager.num_free_blocks == 0
    victim, survivor = ("b", "a") if policy == "fcfs" else ("a", "b")
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {survivor: 1}
    assert out.finished_req_ids == [victim]  # the worker drops the victim's state now
    assert sched.get_request(victim).status == RequestStatus.PREEMPTED
    assert sched.get_request(victim).num_computed_tokens == 0
    assert sched.waiting_req_ids() == [victim]
    assert sched.kv_cache_manager.get_block_ids(victim) == []
    assert sched.get_stats().num_preemptions == 1
    outputs_so_far = list(sched.get_request(victim).output_token_ids)
    assert len(outputs_so_far) == 2
    scheds, outs = run_until_done(sched, worker)
    resent = [n for s in scheds for n in s.scheduled_new_reqs if n.req_id == victim]
    assert resent[0].output_token_ids == outputs_so_far  # re-prefilled after the prompt
    finished = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert sched.kv_cache_manager.num_free_blocks == 4


def test_preempted_request_goes_to_the_front(impl):
    sched, worker = _two_growing_requests(impl, "fcfs", 0, 0)
    sched.add_request(ecr("c", prompt(2, 3), max_tokens=2, arrival=2))
    step(sched, worker)
    assert sched.waiting_req_ids() == ["b", "c"]


def test_preempt_running_frees_every_block_and_keeps_the_order(impl):
    """Sleep mode: every running request back to the queue's head, oldest first, its blocks
    freed and its tokens computed again; the ids the worker holds are returned (dropped with
    the sleep), not reported finished by a later step."""
    sched = make_scheduler(impl)
    for i, name in enumerate("abc"):
        sched.add_request(ecr(name, prompt(i, 6), max_tokens=10, arrival=i))
    worker = FakeWorker()
    step(sched, worker)
    sched.add_request(ecr("d", prompt(3, 6), max_tokens=10, arrival=3))
    free = sched.kv_cache_manager.num_free_blocks
    assert sorted(sched.preempt_running()) == ["a", "b", "c"]  # the worker holds them
    assert sched.running_req_ids() == [] and sched.waiting_req_ids() == ["a", "b", "c", "d"]
    assert sched.kv_cache_manager.num_free_blocks == free + 6
    assert all(sched.get_request(r).num_computed_tokens == 0 for r in "abc")
    for req_id in "abc":  # what the engine core has the workers drop with the sleep
        del worker.reqs[req_id]
    out, _ = step(sched, worker)
    assert out.finished_req_ids == []  # dropped already: never finished and new at once
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b", "c", "d"]
    check_scheduler_invariants(sched, worker)


# ---------------------------------------------------------------- abort


def test_abort_running_takes_effect_within_one_step(impl):
    sched = make_scheduler(impl)
    sched.add_request(ecr("a", prompt(0, 6), max_tokens=10, arrival=0))
    sched.add_request(ecr("b", prompt(1, 6), max_tokens=10, arrival=1))
    worker = FakeWorker()
    step(sched, worker)
    free_before = sched.kv_cache_manager.num_free_blocks
    sched.finish_requests(["a"], FinishReason.ABORT)
    assert sched.kv_cache_manager.get_block_ids("a") == []
    assert sched.kv_cache_manager.num_free_blocks == free_before + 2
    assert sched.get_request("a") is None
    out, _ = step(sched, worker)
    assert "a" not in out.num_scheduled_tokens
    assert out.finished_req_ids == ["a"]
    out, _ = step(sched, worker)
    assert out.finished_req_ids == []  # reported once
    check_scheduler_invariants(sched, worker)


def test_abort_waiting_request_is_not_reported_to_the_worker(impl):
    sched = make_scheduler(impl, max_num_seqs=1)
    sched.add_request(ecr("a", prompt(0, 6), max_tokens=10, arrival=0))
    sched.add_request(ecr("b", prompt(1, 6), max_tokens=10, arrival=1))
    worker = FakeWorker()
    step(sched, worker)
    sched.finish_requests("b", FinishReason.ABORT)
    assert sched.get_request_counts() == (1, 0)
    out, _ = step(sched, worker)
    assert out.finished_req_ids == []
    sched.finish_requests("a", FinishReason.ABORT)
    assert not sched.has_unfinished_requests()
    sched.finish_requests(["a", "unknown"], FinishReason.ABORT)  # no-op


def test_abort_between_schedule_and_update(impl):
    sched = make_scheduler(impl)
    sched.add_request(ecr("a", prompt(0, 6), max_tokens=10))
    out = sched.schedule()
    sched.finish_requests(["a"], FinishReason.ABORT)
    runner_out = ModelRunnerOutput(out.step_id, ["a"], [[3]])
    assert sched.update_from_output(out, runner_out) == []
    assert sched.schedule().finished_req_ids == ["a"]


# ---------------------------------------------------------------- stop conditions


def _finish_of(impl, script, **kw):
    sched = make_scheduler(impl, max_model_len=kw.pop("max_model_len", 256))
    sched.add_request(ecr("r", prompt(0, kw.pop("prompt_len", 5)), **kw))
    _, outs = run_until_done(sched, FakeWorker(token_fn=scripted({"r": script})))
    tokens = [t for o in outs for t in o.new_token_ids]
    last = outs[-1]
    assert last.finished and all(not o.finished for o in outs[:-1])
    return tokens, last.finish_reason, last.stop_reason


def test_stop_on_eos(impl):
    assert _finish_of(impl, [1, 5, 2], eos=5) == ([1, 5], FinishReason.STOP, None)


def test_eos_ignored_before_min_tokens(impl):
    got = _finish_of(impl, [5, 5, 5, 5], eos=5, min_tokens=3)
    assert got == ([5, 5, 5], FinishReason.STOP, None)


def test_ignore_eos(impl):
    got = _finish_of(impl, [5] * 4, eos=5, ignore_eos=True, max_tokens=4)
    assert got == ([5] * 4, FinishReason.LENGTH, None)


def test_stop_token_ids(impl):
    assert _finish_of(impl, [1, 9, 2], stop_token_ids=[9]) == ([1, 9], FinishReason.STOP, 9)
    got = _finish_of(impl, [9, 9, 9, 9], stop_token_ids=[9], min_tokens=3)
    assert got == ([9, 9, 9], FinishReason.STOP, 9)


def test_max_tokens(impl):
    assert _finish_of(impl, [1, 2, 3, 4], max_tokens=3) == ([1, 2, 3], FinishReason.LENGTH, None)


def test_max_model_len(impl):
    got = _finish_of(impl, list(range(10)), max_tokens=None, max_model_len=12, prompt_len=8)
    assert got == ([0, 1, 2, 3], FinishReason.LENGTH, None)


def test_finished_request_frees_blocks_and_is_reported_once(impl):
    sched = make_scheduler(impl, num_blocks=8)
    sched.add_request(ecr("a", prompt(0, 6), max_tokens=1))
    worker = FakeWorker()
    _, outs = step(sched, worker)
    assert outs[0].finished
    assert sched.kv_cache_manager.num_free_blocks == 8
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["a"]
    assert sched.schedule().finished_req_ids == []


# ---------------------------------------------------------------- admission


def test_admission_errors(impl):
    sched = make_scheduler(impl, num_blocks=4, block_size=4, max_model_len=32)
    msg = r"prompt \(20 tokens\) plus max_tokens \(13\) is 33 tokens, more than max_model_len=32"
    with pytest.raises(RequestTooLargeError, match=msg):
        sched.add_request(ecr("a", prompt(0, 20), max_tokens=13))
    msg = r"up to 17 tokens \(5 KV blocks of 4\), more than the KV cache holds \(4 blocks\)"
    with pytest.raises(RequestTooLargeError, match=msg):
        sched.add_request(ecr("b", prompt(0, 10), max_tokens=7))
    with pytest.raises(RequestTooLargeError, match="leaves no room"):
        sched.add_request(ecr("c", prompt(0, 32), max_tokens=None))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(ecr("d", [], max_tokens=1))
    sched.add_request(ecr("ok", prompt(0, 10), max_tokens=6))  # exactly 4 blocks
    with pytest.raises(DuplicateRequestError, match="'ok' is already in use"):
        sched.add_request(ecr("ok", prompt(0, 1), max_tokens=1))
    assert sched.get_request_counts() == (0, 1)


# ---------------------------------------------------------------- prefix cache


def test_prefix_hit_reported_to_worker_and_output(impl):
    sched = make_scheduler(impl)
    sched.add_request(ecr("a", prompt(0, 12), max_tokens=2))
    worker = FakeWorker()
    run_until_done(sched, worker)
    sched.add_request(ecr("b", prompt(0, 12) + [7, 7, 7], max_tokens=2))
    out, outs = step(sched, worker)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12  # three cached full blocks
    assert out.num_scheduled_tokens == {"b": 3}
    assert outs[0].num_cached_tokens == 12
    _, outs = step(sched, worker)
    assert outs[0].num_cached_tokens == 0  # only on the first output
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12 + 15, 12)


def _first_output(sched, worker, req):
    sched.add_request(req)
    outs = []
    while not outs:
        _, outs = step(sched, worker)
    return outs[0]


def test_prompt_tokens_written_to_the_prefix_cache(impl):
    """vLLM's num_cache_creation_tokens: on the first output, the prompt tokens of the
    request's full blocks registered in the cache, less its hits (also when that output
    finishes it and frees the blocks); later outputs 0."""
    sched = make_scheduler(impl)
    worker = FakeWorker()
    cold = _first_output(sched, worker, ecr("a", prompt(0, 14), max_tokens=1))
    assert (cold.num_cached_tokens, cold.num_cache_creation_tokens) == (0, 12)
    warm = _first_output(sched, worker, ecr("b", prompt(0, 14), max_tokens=2))
    assert (warm.num_cached_tokens, warm.num_cache_creation_tokens) == (12, 0)
    _, outs = step(sched, worker)
    assert outs[0].num_cache_creation_tokens == 0  # only on the first output
    longer = _first_output(sched, worker, ecr("c", prompt(0, 14) + [7] * 4, max_tokens=1))
    assert (longer.num_cached_tokens, longer.num_cache_creation_tokens) == (12, 4)
    # a prompt prefilled in chunks: every full block of it, counted once it has its token
    chunked = make_scheduler(impl, max_num_batched_tokens=16)
    out = _first_output(chunked, worker, ecr("d", prompt(1, 41), max_tokens=1))
    assert (out.num_cached_tokens, out.num_cache_creation_tokens) == (0, 40)


def test_prompt_logprobs_chunks_do_not_report_the_cache_writes(impl):
    """Prompt-logprobs outputs of a chunked prefill come before its first token: the writes
    are reported with that token (vLLM's, at its first token), the whole prompt's."""
    from trillm.messages import LogprobsLists

    sched = make_scheduler(impl, max_num_batched_tokens=16)
    sched.add_request(ecr("e", prompt(2, 41), max_tokens=1, prompt_logprobs=1))
    done, created = 0, []
    while done < 41:
        out = sched.schedule()
        n = out.num_scheduled_tokens["e"]
        done += n
        plp = LogprobsLists([[1]] * n, [[-1.0]] * n, [1] * n)
        sampled = [[5]] if done >= 41 else [[]]
        runner_out = ModelRunnerOutput(out.step_id, ["e"], sampled, {}, {"e": plp})
        created += [o.num_cache_creation_tokens for o in sched.update_from_output(out, runner_out)]
    assert created == [0, 0, 40]


def test_no_prompt_tokens_written_without_prefix_caching(impl):
    sched = make_scheduler(impl, enable_prefix_caching=False)
    worker = FakeWorker()
    for rid in ("a", "b"):
        out = _first_output(sched, worker, ecr(rid, prompt(0, 14), max_tokens=1))
        assert (out.num_cached_tokens, out.num_cache_creation_tokens) == (0, 0)


# ---------------------------------------------------------------- seams and stats


def test_spec_decode_rollback(impl):
    sched = make_scheduler(impl)
    sched.add_request(ecr("a", prompt(0, 6), max_tokens=20))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [[1]]))
    sched.update_draft_token_ids({"a": [2, 3, 4]})
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [2, 3, 4]}
    assert sched.get_request("a").num_computed_tokens == 10
    # One draft accepted plus the bonus token: two drafts rejected.
    outs = sched.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [[2, 8]]))
    assert outs[0].new_token_ids == [2, 8]
    req = sched.get_request("a")
    assert (req.num_computed_tokens, req.num_tokens) == (8, 9)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]


def test_structured_output_waits_for_bitmask(impl):
    sched = make_scheduler(impl)
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    sched.add_request(EngineCoreRequest("s", prompt(0, 3), params, 0.0))
    assert sched.schedule().wait_for_bitmask
    sched2 = make_scheduler(impl)
    sched2.add_request(ecr("p", prompt(0, 3)))
    assert not sched2.schedule().wait_for_bitmask


def test_logprobs_pass_through(impl):
    from trillm.messages import LogprobsLists

    sched = make_scheduler(impl)
    sched.add_request(ecr("a", prompt(0, 4), max_tokens=3))
    out = sched.schedule()
    lp = LogprobsLists([[5, 5]], [[-0.1, -0.1]], [1])
    plp = LogprobsLists([[1], [2], [3]], [[-1.0], [-2.0], [-3.0]], [1, 1, 1])
    runner_out = ModelRunnerOutput(out.step_id, ["a"], [[5]], {"a": lp}, {"a": plp})
    (o,) = sched.update_from_output(out, runner_out)
    assert o.new_logprobs is lp and o.new_prompt_logprobs is plp


def test_stats(impl):
    sched = make_scheduler(impl, num_blocks=10, max_num_seqs=1)
    sched.add_request(ecr("a", prompt(0, 8), max_tokens=4))
    sched.add_request(ecr("b", prompt(1, 8), max_tokens=4))
    step(sched, FakeWorker())
    stats = sched.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert (sched.num_running, sched.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)  # 8 tokens -> 2 of 10 blocks


def test_native_switch(monkeypatch):
    from trillm.core.kv_cache_manager import KVCacheManager
    from trillm.core.scheduler import Scheduler

    monkeypatch.setenv("TRILLM_NO_EXTENSIONS", "1")
    assert _native.get_scheduler_cls() is Scheduler
    assert _native.get_kv_cache_manager_cls() is KVCacheManager
    assert not _native.native_available()
    monkeypatch.delenv("TRILLM_NO_EXTENSIONS")
    if _native.native_module("scheduler") is None:
        pytest.skip("native extensions not built")
    assert _native.native_available()
    assert _native.get_scheduler_cls() is _native.native_module("scheduler").Scheduler


def test_priority_preemption_of_a_request_scheduled_earlier_in_the_step(impl):
    # x (less important) is first in the running queue and needs no new block at step 3; y
    # crosses a block boundary then, and takes x's blocks although x was scheduled already.
    sched = make_scheduler(impl, num_blocks=4, block_size=4, policy="priority")
    sched.add_request(ecr("x", prompt(0, 6), max_tokens=8, arrival=0, priority=1))
    sched.add_request(ecr("y", prompt(1, 7), max_tokens=8, arrival=1, priority=0))
    worker = FakeWorker()
    for _ in range(2):
        step(sched, worker)
    out, outs = step(sched, worker)
    assert out.num_scheduled_tokens == {"y": 1}
    assert out.total_num_scheduled_tokens == 1
    assert out.scheduled_cached_reqs.req_ids == ["y"]
    assert out.finished_req_ids == ["x"]
    assert [o.request_id for o in outs] == ["y"]
    assert sched.get_request("x").num_computed_tokens == 0
    check_scheduler_invariants(sched, worker)


# ---------------------------------------------------------------- batch queue (pipeline stages)


def test_busy_requests_are_not_scheduled_again(impl):
    """A request of a step still in flight (``busy``) gets no tokens, even with prompt left
    (a chunk in flight); the others and waiting requests are scheduled as usual."""
    sched = make_scheduler(impl, max_num_batched_tokens=8)
    sched.add_request(ecr("a", prompt(0, 3), max_tokens=4, arrival=0))
    sched.add_request(ecr("c", prompt(2, 12), max_tokens=2, arrival=1))
    worker = FakeWorker()
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 3, "c": 5}
    sched.add_request(ecr("b", prompt(1, 3), max_tokens=4, arrival=2))
    second = sched.schedule(busy=set(first.num_scheduled_tokens))
    assert second.num_scheduled_tokens == {"b": 3}  # c's 7 prompt tokens wait for its step
    outs = []
    for out in (first, second):  # outputs applied in step order
        outs += sched.update_from_output(out, worker.execute(out))
    check_scheduler_invariants(sched, worker)
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    third = sched.schedule(busy={"b"})
    assert third.num_scheduled_tokens == {"a": 1, "c": 7}


def test_max_reqs_caps_one_step(impl):
    """``max_reqs``: one step's share of the requests, running ones first, then admissions;
    the rest run in the next step (in flight beside it)."""
    sched = make_scheduler(impl)
    for i, name in enumerate("abcde"):
        sched.add_request(ecr(name, prompt(i, 3), max_tokens=4, arrival=i))
    first = sched.schedule(max_reqs=3)
    assert list(first.num_scheduled_tokens) == ["a", "b", "c"]
    assert sched.waiting_req_ids() == ["d", "e"]
    second = sched.schedule(busy=set(first.num_scheduled_tokens), max_reqs=3)
    assert list(second.num_scheduled_tokens) == ["d", "e"]
    worker = FakeWorker()
    for out in (first, second):
        sched.update_from_output(out, worker.execute(out))
    third = sched.schedule(busy=set(second.num_scheduled_tokens), max_reqs=2)
    assert third.num_scheduled_tokens == {"a": 1, "b": 1}
    check_scheduler_invariants(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_busy_request_is_never_preempted(impl, policy):
    """Out of blocks, the victim the policy would pick is in flight: the scheduler preempts
    among the others (here the request that needs room itself) and leaves the busy one be."""
    sched, worker = _two_growing_requests(impl, policy, pa=1, pb=0)
    usual_victim, other = ("b", "a") if policy == "fcfs" else ("a", "b")
    out = sched.schedule(busy={usual_victim})
    worker.execute(out)
    assert out.num_scheduled_tokens == {}
    assert out.finished_req_ids == [other]
    assert sched.get_request(other).status == RequestStatus.PREEMPTED
    assert sched.get_request(usual_victim).status == RequestStatus.RUNNING
    assert len(sched.kv_cache_manager.get_block_ids(usual_victim)) == 2
    check_scheduler_invariants(sched, worker)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_batch_queue_gives_the_same_tokens_under_preemption(impl, depth):
    """Up to ``depth`` steps in flight over disjoint requests (the worker runs each step when
    it is sent, the scheduler sees its output steps later), on a cache too small for all:
    every request ends with its script, as with one step at a time."""
    scripts = {name: [100 + 10 * i + k for k in range(6)] for i, name in enumerate("abcde")}
    sched = make_scheduler(impl, num_blocks=8, block_size=4, max_num_batched_tokens=8)
    for i, name in enumerate(scripts):
        sched.add_request(ecr(name, prompt(i, 5 + i), max_tokens=6, arrival=i))
    worker = FakeWorker(token_fn=scripted(scripts))
    queue: list = []  # (scheduler output, worker output), oldest first
    tokens: dict[str, list[int]] = {name: [] for name in scripts}
    max_depth = 0
    for _ in range(300):
        if not sched.has_unfinished_requests() and not queue:
            break
        if len(queue) < depth:
            busy = {r for out, _ in queue for r in out.num_scheduled_tokens}
            share = -(-sum(sched.get_request_counts()) // depth)
            out = sched.schedule(busy=busy, max_reqs=share)
            assert not busy & set(out.num_scheduled_tokens)
            if out.total_num_scheduled_tokens:
                queue.append((out, worker.execute(out)))
                max_depth = max(max_depth, len(queue))
                continue
            worker.execute(out)  # its finished ids only
        out, runner_out = queue.pop(0)
        for o in sched.update_from_output(out, runner_out):
            tokens[o.request_id] += o.new_token_ids
        check_scheduler_invariants(sched, worker)
    assert tokens == scripts
    assert max_depth == depth
    assert sched.get_stats().num_preemptions > 0
