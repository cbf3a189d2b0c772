"""The scheduler with the shared-storage connector (kv_transfer/scheduler_side.py): what it
asks the connector, the blocks it allocates for loaded tokens, the loads and saves each step
hands the worker, and the external prefix-cache counters; and that the engine picks it."""

from __future__ import annotations

import pytest
from scheduler_twin_helpers import IMPL_NAMES, ecr, get_impl

from trillm._native import get_scheduler_cls
from trillm.config import CacheConfig, SchedulerConfig
from trillm.engine.engine_cores import make_scheduler
from trillm.kv_transfer import storage
from trillm.kv_transfer.config import parse_kv_transfer_config
from trillm.kv_transfer.scheduler_side import (
    ConnectorScheduler,
    ConnectorSteps,
    connector_scheduler_cls,
)
from trillm.kv_transfer.shared_storage import SharedStorageScheduler
from trillm.kv_transfer.storage import Header, file_path, payload_digest, prefix_key, write_file
from trillm.messages import ModelRunnerOutput
from trillm.worker.fake_runner import make_fake_config

BLOCK = 4
IDENTITY = "test-identity"


@pytest.fixture(params=IMPL_NAMES)
def impl(request):
    """Each test runs on both scheduler twins, each with the connector's steps."""
    return get_impl(request.param)


def _scheduler(impl, folder: str, role: str, chunk: int = 0) -> ConnectorSteps:
    kv = parse_kv_transfer_config(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": folder},
        }
    )
    assert kv is not None
    connector = SharedStorageScheduler(kv, IDENTITY, BLOCK)
    return connector_scheduler_cls(impl.Scheduler)(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=128,
            long_prefill_token_threshold=chunk,
        ),
        CacheConfig(block_size=BLOCK),
        32,
        connector,
    )


def _store(folder: str, tokens: list[int], bytes_per_token: int = 8) -> None:
    """A whole file for the block-aligned prefix of ``tokens`` short of the last token."""
    n = (len(tokens) - 1) // BLOCK * BLOCK
    payload = bytes(bytes_per_token * n)
    header = Header(
        IDENTITY, n, 1, 2, [1, 1], "torch.float32", len(payload), payload_digest(payload)
    )
    write_file(file_path(folder, prefix_key(IDENTITY, tokens[:n], None, [])), header, payload)


def test_a_stored_prompt_is_loaded_into_its_new_blocks_and_counted(impl, tmp_path):
    sched = _scheduler(impl, str(tmp_path), "kv_consumer")
    tokens = list(range(100, 111))  # 11 tokens: 8 stored (2 blocks), 3 computed
    _store(str(tmp_path), tokens)
    sched.add_request(ecr("a", tokens, 4))
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.kv_connector_step is not None and not out.kv_connector_step.saves
    (load,) = out.kv_connector_step.loads
    assert (load.block_ids, load.num_tokens, load.first_block) == (new.block_ids[:2], 8, 0)
    stats = sched.get_stats()
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (11, 8)
    assert sched.get_request("a").num_cached_tokens == 8


def test_a_local_prefix_hit_is_not_loaded_again(impl, tmp_path):
    sched = _scheduler(impl, str(tmp_path), "kv_consumer")
    tokens = list(range(200, 213))  # 13 tokens: 12 stored (3 blocks)
    _store(str(tmp_path), tokens)
    sched.add_request(ecr("a", tokens[:9], 1))  # computes and caches the first 2 blocks here
    out = sched.schedule()
    assert out.kv_connector_step.loads == []
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [[7]]))
    sched.add_request(ecr("b", tokens, 1))
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    (load,) = out.kv_connector_step.loads
    assert new.num_computed_tokens == 12  # 8 local + 4 loaded
    assert (load.first_block, load.block_ids) == (2, new.block_ids[:3])
    assert sched.get_stats().external_prefix_cache_hits == 4


def test_a_failed_load_goes_back_to_the_local_hit_and_is_computed(impl, tmp_path):
    """kv_load_failure_policy "recompute": the worker reports the load failed (the step ran
    without the request); its computed count goes back to its local prefix hit, the next
    step computes the rest of its prompt, and its file is not asked for again."""
    sched = _scheduler(impl, str(tmp_path), "kv_consumer")
    tokens = list(range(200, 213))  # 13 tokens: 12 stored (3 blocks)
    _store(str(tmp_path), tokens)
    sched.add_request(ecr("a", tokens[:9], 1))  # computes and caches the first 2 blocks here
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [[7]]))
    sched.add_request(ecr("b", tokens, 1))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 1} and len(out.kv_connector_step.loads) == 1
    failed = ModelRunnerOutput(out.step_id, [], [], kv_load_failed={"b": "damaged"})
    sched.recompute_failed_loads(failed.kv_load_failed)
    sched.update_from_output(out, failed)
    request = sched.get_request("b")
    assert (request.num_computed_tokens, request.num_cached_tokens) == (8, 8)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 5}
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert out.kv_connector_step.loads == []
    assert sched.get_stats().external_prefix_cache_hits == 0
    assert sched.num_kv_load_failures == 1


def test_kv_both_saves_a_failed_load_once_computed(impl, tmp_path):
    """Its file failed to load: once its prompt is computed, kv_both saves it over that file."""
    sched = _scheduler(impl, str(tmp_path), "kv_both")
    tokens = list(range(900, 911))
    _store(str(tmp_path), tokens)
    sched.add_request(ecr("a", tokens, 2))
    out = sched.schedule()
    assert out.kv_connector_step.saves == [] and len(out.kv_connector_step.loads) == 1
    sched.recompute_failed_loads({"a": "damaged"})
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, [], []))
    (save,) = sched.schedule().kv_connector_step.saves
    assert (save.req_id, save.num_tokens) == ("a", 8)


def test_a_missing_or_damaged_file_is_no_match(impl, tmp_path):
    sched = _scheduler(impl, str(tmp_path), "kv_consumer")
    tokens = list(range(300, 311))
    _store(str(tmp_path), tokens)
    (name,) = [p for p in tmp_path.iterdir()]
    name.write_bytes(name.read_bytes()[:-1])
    sched.add_request(ecr("a", tokens, 1))
    sched.add_request(ecr("b", list(range(400, 411)), 1))  # no file at all
    out = sched.schedule()
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0, 0]
    assert out.kv_connector_step.loads == []
    assert sched.get_stats().external_prefix_cache_hits == 0


def test_the_lookup_reads_the_header_alone(impl, tmp_path, monkeypatch):
    """The scheduler's lookup runs on the engine loop: one small read whatever the prompt's
    size, no payload read or hashed (the worker checks the digest where it loads)."""
    sched = _scheduler(impl, str(tmp_path), "kv_consumer")
    tokens = list(range(800, 921))  # 120 tokens stored, 128 KiB each: 15 MiB of payload
    _store(str(tmp_path), tokens, bytes_per_token=1 << 17)
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # damaged payload, whole size: only the worker's digest can tell
    path.write_bytes(bytes(data))
    read: list[int] = []

    def counting_open(file, mode="r"):
        handle = open(file, mode)
        real_read = handle.read
        handle.read = lambda size=-1: read.append(len(got := real_read(size))) or got
        return handle

    def no_digest(payload):
        raise AssertionError("the scheduler hashed the payload")

    monkeypatch.setattr(storage, "open", counting_open, raising=False)
    monkeypatch.setattr(storage, "payload_digest", no_digest)
    sched.add_request(ecr("a", tokens, 1))
    (new,) = sched.schedule().scheduled_new_reqs
    assert new.num_computed_tokens == 120
    assert len(read) == 1 and read[0] <= storage.HEADER_READ_BYTES


def test_a_producer_saves_each_prompt_once_when_its_last_chunk_is_scheduled(impl, tmp_path):
    sched = _scheduler(impl, str(tmp_path), "kv_producer", chunk=5)
    tokens = list(range(500, 510))  # 10 tokens: 8 stored; chunks of 5 and 5
    sched.add_request(ecr("a", tokens, 2))
    first = sched.schedule()
    assert first.kv_connector_step.saves == []
    sched.update_from_output(first, ModelRunnerOutput(first.step_id, ["a"], [[]]))
    second = sched.schedule()
    (save,) = second.kv_connector_step.saves
    assert (save.num_tokens, save.block_ids) == (8, sched.kv_cache_manager.get_block_ids("a")[:2])
    assert save.key == prefix_key(IDENTITY, tokens[:8], None, [])
    sched.update_from_output(second, ModelRunnerOutput(second.step_id, ["a"], [[9]]))
    assert sched.schedule().kv_connector_step.saves == []  # decode steps save nothing


def test_kv_both_saves_what_it_computed_and_not_what_it_loaded(impl, tmp_path):
    sched = _scheduler(impl, str(tmp_path), "kv_both")
    stored, fresh = list(range(600, 611)), list(range(700, 711))
    _store(str(tmp_path), stored)
    sched.add_request(ecr("loaded", stored, 2))
    sched.add_request(ecr("computed", fresh, 2))
    step = sched.schedule().kv_connector_step
    assert [item.req_id for item in step.loads] == ["loaded"]
    assert [item.req_id for item in step.saves] == ["computed"]


def test_the_engine_runs_the_connector_scheduler_when_configured(tmp_path, monkeypatch):
    config = make_fake_config()
    config.kv_transfer = parse_kv_transfer_config(
        {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}
    )
    sched = make_scheduler(config, 16)
    # on the native twin when it is built (the default), else on the Python one
    assert isinstance(sched, ConnectorSteps) and isinstance(sched, get_scheduler_cls())
    monkeypatch.setenv("TRILLM_NO_EXTENSIONS", "1")
    assert isinstance(make_scheduler(config, 16), ConnectorScheduler)
    config.kv_transfer = None
    assert not isinstance(make_scheduler(config, 16), ConnectorSteps)
