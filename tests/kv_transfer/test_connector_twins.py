"""Both scheduler twins with the shared-storage connector (scheduler_side.ConnectorSteps on
trillm._ext.scheduler and on core/scheduler.py) take the same decisions: the same requests,
aborts, saved files and failed loads give identical SchedulerOutputs (the connector's loads
and saves included), outputs and stats, step by step, with preemption (few blocks), local
prefix-cache hits and loads from files a kv_both instance saved earlier."""

from __future__ import annotations

import random

import pytest
from scheduler_twin_helpers import IMPL_NAMES, ecr, get_impl

from trillm.config import CacheConfig, SchedulerConfig
from trillm.core.request import FinishReason
from trillm.kv_transfer.config import parse_kv_transfer_config
from trillm.kv_transfer.scheduler_side import ConnectorSteps, connector_scheduler_cls
from trillm.kv_transfer.shared_storage import SharedStorageScheduler
from trillm.kv_transfer.storage import Header, file_path, payload_digest, prefix_key, write_file
from trillm.messages import ModelRunnerOutput, SchedulerOutput

BLOCK = 4
IDENTITY = "test-identity"


def _twin(name: str, folder: str) -> ConnectorSteps:
    kv = parse_kv_transfer_config(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": folder},
        }
    )
    assert kv is not None
    return connector_scheduler_cls(get_impl(name).Scheduler)(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=128),
        CacheConfig(block_size=BLOCK),
        12,
        SharedStorageScheduler(kv, IDENTITY, BLOCK),
    )


def _write(folder: str, key: str, num_tokens: int) -> None:
    payload = bytes(8 * num_tokens)
    header = Header(
        IDENTITY, num_tokens, 1, 2, [1, 1], "torch.float32", len(payload), payload_digest(payload)
    )
    write_file(file_path(folder, key), header, payload)


def _store(folder: str, tokens: list[int]) -> None:
    """The file a producer writes for a prompt of ``tokens`` and one more token."""
    _write(folder, prefix_key(IDENTITY, tokens, None, []), len(tokens))


class _Worker:
    """A model runner's view of the steps: computed counts as the messages say; the saves
    written to its folder; the requests whose load is to fail left out of the step."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.reqs: dict[str, list[int]] = {}  # req_id -> [num_computed, num_tokens]

    def execute(self, out: SchedulerOutput, fail: set[str]) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.reqs[new.req_id] = [new.num_computed_tokens, num_tokens]
        cached = out.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.reqs[req_id][0] = computed
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            if req_id in fail:
                continue  # NOTE: as the model runner: the step runs without it
            state = self.reqs[req_id]
            state[0] += n
            req_ids.append(req_id)
            if state[0] >= state[1]:
                sampled.append([(sum(map(ord, req_id)) * 31 + state[1]) % 50])
                state[1] += 1
            else:
                sampled.append([])
        assert out.kv_connector_step is not None
        for item in out.kv_connector_step.saves:
            _write(self.folder, item.key, item.num_tokens)
        return ModelRunnerOutput(
            step_id=out.step_id,
            req_ids=req_ids,
            sampled_token_ids=sampled,
            kv_load_failed={req_id: "lost" for req_id in fail},
        )


def _step(sched: ConnectorSteps, worker: _Worker, fail_first_load: bool):
    out = sched.schedule()
    assert out.kv_connector_step is not None
    loads = out.kv_connector_step.loads
    fail = {loads[0].req_id} if fail_first_load and loads else set()
    runner_out = worker.execute(out, fail)
    sched.recompute_failed_loads(runner_out.kv_load_failed)  # as the engine core, first
    return out, sched.update_from_output(out, runner_out)


@pytest.mark.parametrize("seed", range(3))
def test_the_twins_take_the_same_connector_decisions(seed, tmp_path):
    rng = random.Random(seed)
    families = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
    folders = [str(tmp_path / name) for name in IMPL_NAMES]
    twins, workers = [], []
    for name, folder in zip(IMPL_NAMES, folders):
        (tmp_path / name).mkdir()
        for family in families:
            _store(folder, family[:8])
        twins.append(_twin(name, folder))
        workers.append(_Worker(folder))
    loads = saves = 0
    for i in range(300):
        roll = rng.random()
        if roll < 0.2:
            prompt = rng.choice(families)[: rng.randrange(5, 30)]
            req = ecr(f"r{i}", prompt, rng.randrange(1, 12))
            for sched in twins:
                sched.add_request(req)
        elif roll < 0.23 and twins[0].waiting_req_ids() + twins[0].running_req_ids():
            victim = rng.choice(twins[0].waiting_req_ids() + twins[0].running_req_ids())
            for sched in twins:
                sched.finish_requests(victim, FinishReason.ABORT)
        else:
            fail = rng.random() < 0.3
            results = [_step(sched, worker, fail) for sched, worker in zip(twins, workers)]
            assert results[0] == results[1], f"diverged at event {i}"
            step = results[0][0].kv_connector_step
            loads += len(step.loads)
            saves += len(step.saves)
    stats = twins[0].get_stats()
    assert stats == twins[1].get_stats()
    assert twins[0].num_kv_load_failures == twins[1].num_kv_load_failures > 0
    assert stats.external_prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert stats.prefix_cache_hits > 0 and loads > 0 and saves > 0
