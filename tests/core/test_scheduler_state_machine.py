"""Property tests of the scheduler + KV block manager, run against both twins:

- a hypothesis RuleBasedStateMachine (add / step / abort / finish) checking after every rule
  that no block leaks or is freed twice, refcounts equal the number of block tables holding
  each block, the worker's view built from the diffs equals the scheduler's, the token budget
  and max_num_seqs hold, and at teardown that every request finishes within a bounded number
  of steps;
- a differential test: the native and Python twins fed the same random workload produce
  identical SchedulerOutputs, EngineCoreOutputs and stats at every step.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from scheduler_twin_helpers import (
    NATIVE_KV,
    NATIVE_SCHED,
    NOT_BUILT,
    FakeWorker,
    check_scheduler_invariants,
    ecr,
    get_impl,
    make_scheduler,
    step,
)

from trillm.core.errors import RequestTooLargeError
from trillm.messages import FinishReason

native_missing = pytest.mark.skipif(NATIVE_SCHED is None or NATIVE_KV is None, reason=NOT_BUILT)

DEFAULT = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# The slow runs: histories twice as long as DEFAULT's, twice as many examples. Each run draws
# new examples (not derandomized), so CI's bounded count adds up over runs;
# TRILLM_LONG_STATE_MACHINE_EXAMPLES=N draws N in one run when exploring.
LONG = settings(
    DEFAULT,
    max_examples=int(os.environ.get("TRILLM_LONG_STATE_MACHINE_EXAMPLES", "100")),
    stateful_step_count=80,
)

EOS = 3
VOCAB = 40
# A few shared prefixes so requests hit each other's cached blocks.
PREFIXES = [[random.Random(i).randrange(VOCAB) for _ in range(48)] for i in range(3)]

configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(4, 40),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "max_num_batched_tokens": st.integers(1, 64),
        "max_num_seqs": st.integers(1, 8),
        "max_model_len": st.integers(8, 80),
        "long_prefill_token_threshold": st.sampled_from([0, 0, 1, 3, 8]),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "enable_prefix_caching": st.booleans(),
    }
)

requests = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, len(PREFIXES) - 1),
        "prefix_len": st.integers(0, 40),
        "tail": st.lists(st.integers(0, VOCAB - 1), max_size=12),
        "max_tokens": st.one_of(st.none(), st.integers(1, 24)),
        "min_tokens": st.integers(0, 3),
        "priority": st.integers(0, 3),
        "eos": st.sampled_from([None, EOS]),
        "ignore_eos": st.booleans(),
        "stop": st.sampled_from([None, [5], [5, 7]]),
        "salt": st.sampled_from([None, None, "s1"]),
    }
)


def build_request(req_id: str, spec: dict, arrival: float):
    prompt = PREFIXES[spec["prefix"]][: spec["prefix_len"]] + spec["tail"]
    max_tokens = spec["max_tokens"]
    min_tokens = min(spec["min_tokens"], max_tokens) if max_tokens else spec["min_tokens"]
    return ecr(
        req_id,
        prompt,
        max_tokens,
        arrival=arrival,
        priority=spec["priority"],
        eos=spec["eos"],
        min_tokens=min_tokens,
        ignore_eos=spec["ignore_eos"],
        stop_token_ids=spec["stop"],
        cache_salt=spec["salt"],
    )


def too_large(req, cfg) -> bool:
    n = len(req.prompt_token_ids)
    max_tokens = req.sampling_params.max_tokens
    if n == 0:
        return True
    if max_tokens is None:
        total = cfg["max_model_len"]
        if n >= total:
            return True
    else:
        total = n + max_tokens
        if total > cfg["max_model_len"]:
            return True
    return -(-total // cfg["block_size"]) > cfg["num_blocks"]


def drain_bound(sched) -> int:
    return 50 + 20 * sum(
        sched.get_request(r).num_prompt_tokens + 100
        for r in sched.running_req_ids() + sched.waiting_req_ids()
    )


class SchedulerMachine(RuleBasedStateMachine):
    impl_name = "python"

    def __init__(self) -> None:
        super().__init__()
        self.sched = None

    @initialize(cfg=configs, seed=st.integers(0, 2**16))
    def setup(self, cfg, seed):
        self.cfg = cfg
        self.sched = make_scheduler(get_impl(self.impl_name), **cfg)
        self.worker = FakeWorker(seed=seed, vocab=VOCAB)
        self.live: set[str] = set()
        self.num_added = 0
        self.num_outputs: dict[str, int] = {}

    @rule(spec=requests)
    def add_request(self, spec):
        req_id = f"r{self.num_added}"
        req = build_request(req_id, spec, arrival=float(self.num_added))
        self.num_added += 1
        if req.prompt_token_ids == [] or too_large(req, self.cfg):
            with pytest.raises((RequestTooLargeError, ValueError)):
                self.sched.add_request(req)
            return
        self.sched.add_request(req)
        self.live.add(req_id)
        self.num_outputs[req_id] = 0

    @rule()
    def step(self):
        out, outs = step(self.sched, self.worker)
        for o in outs:
            assert o.request_id in self.live
            self.num_outputs[o.request_id] += len(o.new_token_ids)
            if o.finished:
                self.live.remove(o.request_id)
        if self.sched.has_unfinished_requests() or out.scheduled_new_reqs:
            # Progress every step: admission guarantees a lone request always fits.
            assert out.total_num_scheduled_tokens > 0

    @precondition(lambda self: self.sched is not None and self.live)
    @rule(data=st.data())
    def abort(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.finish_requests([req_id], FinishReason.ABORT)
        self.live.remove(req_id)
        assert self.sched.get_request(req_id) is None
        assert self.sched.kv_cache_manager.get_block_ids(req_id) == []

    @precondition(lambda self: self.sched is not None and self.live)
    @rule(data=st.data())
    def finish_by_stop_string(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.finish_requests(req_id, FinishReason.STOP)
        self.live.remove(req_id)

    @invariant()
    def consistent(self):
        if self.sched is None:
            return
        check_scheduler_invariants(self.sched, self.worker)
        assert set(self.sched.running_req_ids() + self.sched.waiting_req_ids()) == self.live
        for req_id in self.live:
            req = self.sched.get_request(req_id)
            assert req.num_output_tokens == self.num_outputs[req_id]
            if req.max_tokens is not None:
                assert req.num_output_tokens <= req.max_tokens
            assert req.num_tokens <= self.sched.max_model_len

    def teardown(self):
        if self.sched is None:
            return
        for _ in range(drain_bound(self.sched)):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
            check_scheduler_invariants(self.sched, self.worker)
        assert not self.sched.has_unfinished_requests(), "requests did not finish"
        assert not self.live
        kv = self.sched.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
        assert kv.get_ref_counts() == [0] * kv.num_blocks


class NativeSchedulerMachine(SchedulerMachine):
    impl_name = "native"


TestPythonSchedulerMachine = SchedulerMachine.TestCase
TestPythonSchedulerMachine.settings = DEFAULT
TestNativeSchedulerMachine = native_missing(NativeSchedulerMachine.TestCase)
TestNativeSchedulerMachine.settings = DEFAULT


@pytest.mark.slow
@pytest.mark.parametrize("machine", [SchedulerMachine, NativeSchedulerMachine])
def test_state_machine_long(machine):
    if machine is NativeSchedulerMachine and NATIVE_SCHED is None:
        pytest.skip(NOT_BUILT)
    run_state_machine_as_test(machine, settings=LONG)


# ---------------------------------------------------------------- differential


def run_side_by_side(cfg, events, seed):
    """Feed both twins the same events; compare every message they produce."""
    twins = [make_scheduler(get_impl(name), **cfg) for name in ("python", "native")]
    workers = [FakeWorker(seed=seed, vocab=VOCAB) for _ in twins]
    added: list[str] = []
    rng = random.Random(seed)
    for i, event in enumerate(events):
        if event == "step":
            results = [step(s, w) for s, w in zip(twins, workers)]
            assert results[0] == results[1], f"diverged at event {i}"
        elif event == "abort" and added:
            victim = added[rng.randrange(len(added))]
            for s in twins:
                s.finish_requests([victim], FinishReason.ABORT)
        elif isinstance(event, dict):
            req_id = f"r{len(added)}"
            req = build_request(req_id, event, arrival=float(len(added)))
            errors = []
            for s in twins:
                try:
                    s.add_request(req)
                    errors.append(None)
                except ValueError as exc:
                    errors.append((type(exc), str(exc)))
            assert errors[0] == errors[1]
            added.append(req_id)
        assert twins[0].get_stats() == twins[1].get_stats()
        assert twins[0].running_req_ids() == twins[1].running_req_ids()
        assert twins[0].waiting_req_ids() == twins[1].waiting_req_ids()
    kv = [s.kv_cache_manager for s in twins]
    assert kv[0].free_block_ids() == kv[1].free_block_ids()
    assert kv[0].get_ref_counts() == kv[1].get_ref_counts()


events = st.lists(
    st.one_of(st.just("step"), st.just("step"), st.just("step"), st.just("abort"), requests),
    max_size=80,
)


@native_missing
@DEFAULT
@given(cfg=configs, events=events, seed=st.integers(0, 2**16))
def test_twins_produce_identical_outputs(cfg, events, seed):
    run_side_by_side(cfg, events + ["step"] * 30, seed)


@native_missing
@pytest.mark.parametrize("seed", range(3))
def test_twins_identical_on_a_long_random_workload(seed):
    rng = random.Random(seed)
    cfg = {
        "num_blocks": 48,
        "block_size": 4,
        "max_num_batched_tokens": 48,
        "max_num_seqs": 6,
        "max_model_len": 96,
        "long_prefill_token_threshold": 16,
        "policy": ["fcfs", "priority"][seed % 2],
        "enable_prefix_caching": True,
    }
    evs: list = []
    for _ in range(400):
        r = rng.random()
        if r < 0.15:
            evs.append(
                {
                    "prefix": rng.randrange(3),
                    "prefix_len": rng.randrange(40),
                    "tail": [rng.randrange(VOCAB) for _ in range(rng.randrange(8))],
                    "max_tokens": rng.choice([None, rng.randrange(1, 30)]),
                    "min_tokens": rng.randrange(3),
                    "priority": rng.randrange(4),
                    "eos": rng.choice([None, EOS]),
                    "ignore_eos": rng.random() < 0.3,
                    "stop": rng.choice([None, [5]]),
                    "salt": rng.choice([None, "s1"]),
                }
            )
        elif r < 0.18:
            evs.append("abort")
        else:
            evs.append("step")
    run_side_by_side(cfg, evs, seed)
