"""Shared by the scheduler / KV manager tests: the two twins, a fake worker, invariants."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import trio

from trillm import _native
from trillm.config import CacheConfig, SchedulerConfig
from trillm.core import kv_cache_manager as py_kv
from trillm.core import request as py_request
from trillm.core import scheduler as py_scheduler
from trillm.executor.abstract import Executor
from trillm.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from trillm.sampling_params import SamplingParams

NATIVE_SCHED = _native.native_module("scheduler")
NATIVE_KV = _native.native_module("kv_cache_manager")
NOT_BUILT = (
    "native extensions not built: run `python setup.py build_ext --inplace` "
    "(trillm._ext.scheduler / trillm._ext.kv_cache_manager missing)"
)


def _python_impl() -> SimpleNamespace:
    return SimpleNamespace(
        name="python",
        Scheduler=py_scheduler.Scheduler,
        KVCacheManager=py_kv.KVCacheManager,
        Request=py_request.Request,
        hash_block_tokens=py_kv.hash_block_tokens,
    )


def _native_impl() -> SimpleNamespace:
    if NATIVE_SCHED is None or NATIVE_KV is None:
        pytest.skip(NOT_BUILT)
    return SimpleNamespace(
        name="native",
        Scheduler=NATIVE_SCHED.Scheduler,
        KVCacheManager=NATIVE_KV.KVCacheManager,
        Request=NATIVE_KV.Request,
        hash_block_tokens=NATIVE_KV.hash_block_tokens,
    )


IMPL_NAMES = ["python", "native"]


def get_impl(name: str) -> SimpleNamespace:
    return _python_impl() if name == "python" else _native_impl()


def ecr(
    req_id: str,
    prompt: list[int],
    max_tokens: int | None = 16,
    *,
    arrival: float = 0.0,
    priority: int = 0,
    eos: int | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    cache_salt: str | None = None,
    extra_hash_keys: list[str] | None = None,
    prompt_logprobs: int | None = None,
) -> EngineCoreRequest:
    params = SamplingParams(
        prompt_logprobs=prompt_logprobs,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
    )
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        arrival_time=arrival,
        eos_token_id=eos,
        priority=priority,
        cache_salt=cache_salt,
        extra_hash_keys=list(extra_hash_keys or []),
    )


def make_scheduler(
    impl: SimpleNamespace,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int | None = None,
    max_model_len: int = 256,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
):
    """``max_num_seqs`` left unset: 16, at most the budget (as the engine resolves it: a
    budget below the batch is refused, trillm/config/batch_defaults.py)."""
    sched_cfg = SchedulerConfig(
        max_num_seqs=min(16, max_num_batched_tokens) if max_num_seqs is None else max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,  # type: ignore[arg-type]
    )
    cache_cfg = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return impl.Scheduler(sched_cfg, cache_cfg, num_blocks)


@dataclass
class _WorkerReq:
    block_ids: list[int]
    num_computed: int
    num_tokens: int


class FakeWorker:
    """Applies SchedulerOutput diffs as a model runner's persistent batch would, and samples a
    token for every request whose scheduled tokens reach its end. Checks the diffs are
    self-consistent (a cached request is known, its computed count matches)."""

    def __init__(self, seed: int = 0, vocab: int = 50, token_fn=None) -> None:
        self.reqs: dict[str, _WorkerReq] = {}
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.token_fn = token_fn

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent in full twice"
            num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.reqs[new.req_id] = _WorkerReq(
                list(new.block_ids), new.num_computed_tokens, num_tokens
            )
        cached = sched.scheduled_cached_reqs
        for req_id, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.reqs[req_id]
            assert state.num_computed == computed, (req_id, state.num_computed, computed)
            state.block_ids.extend(blocks)
        req_ids, sampled = [], []
        for req_id, n in sched.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            state.num_computed += n
            req_ids.append(req_id)
            if state.num_computed >= state.num_tokens:
                token = self.token_fn(req_id) if self.token_fn else self.rng.randrange(self.vocab)
                state.num_tokens += 1
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(step_id=sched.step_id, req_ids=req_ids, sampled_token_ids=sampled)


def check_kv_invariants(kv, tables: dict[str, list[int]]) -> None:
    """No block leaked or double freed; refcounts equal the number of tables holding a block."""
    refs = kv.get_ref_counts()
    free = kv.free_block_ids()
    assert len(free) == len(set(free)) == kv.num_free_blocks
    assert all(refs[b] == 0 for b in free)
    assert all(r >= 0 for r in refs)
    num_referenced = sum(1 for r in refs if r > 0)
    assert kv.num_free_blocks + num_referenced == kv.num_blocks
    expected = [0] * kv.num_blocks
    for blocks in tables.values():
        for b in blocks:
            expected[b] += 1
    assert refs == expected
    assert abs(kv.usage - num_referenced / kv.num_blocks) < 1e-9


def check_scheduler_invariants(sched, worker: FakeWorker | None = None) -> None:
    kv = sched.kv_cache_manager
    running = sched.running_req_ids()
    waiting = sched.waiting_req_ids()
    assert len(running) <= sched.max_num_seqs
    assert not set(running) & set(waiting)
    assert sched.get_request_counts() == (len(running), len(waiting))
    tables = {r: kv.get_block_ids(r) for r in running}
    for req_id in waiting:
        assert kv.get_block_ids(req_id) == []
    check_kv_invariants(kv, tables)
    for req_id in running:
        req = sched.get_request(req_id)
        assert len(tables[req_id]) * kv.block_size >= req.num_computed_tokens
        if worker is not None:
            assert worker.reqs[req_id].block_ids == tables[req_id]


def check_output_limits(sched, out: SchedulerOutput) -> None:
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
    assert all(n > 0 for n in out.num_scheduled_tokens.values())
    if sched.long_prefill_token_threshold > 0:
        assert all(
            n <= sched.long_prefill_token_threshold for n in out.num_scheduled_tokens.values()
        )
    new_ids = [n.req_id for n in out.scheduled_new_reqs]
    listed = new_ids + list(out.scheduled_cached_reqs.req_ids)
    assert sorted(listed) == sorted(out.num_scheduled_tokens)
    assert not set(new_ids) & set(out.finished_req_ids)


def step(sched, worker: FakeWorker):
    out = sched.schedule()
    check_output_limits(sched, out)
    runner_out = worker.execute(out)
    return out, sched.update_from_output(out, runner_out)


class InProcessStubExecutor(Executor):
    """A stand-in executor for engine-core tests: the Executor contract's service half (start,
    health, shutdown) does nothing; subclasses compute the steps."""

    num_blocks = 64

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    def check_health(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass
