"""The shared-storage folder's bound (kv_connector_extra_config.max_local_disk_size, LMCache's
name): a producer evicts the least recently used files to stay under it, a file over it alone
is not written, a consumer whose file was evicted recomputes, and a bad cap is refused."""

from __future__ import annotations

import logging
import math
import os

import pytest
from kv_connectors import kv_engine, shared_storage_kv

from trillm import LLM, SamplingParams
from trillm.kv_transfer import shared_storage
from trillm.kv_transfer.config import parse_kv_transfer_config
from trillm.kv_transfer.disk_budget import DiskBudget
from trillm.kv_transfer.storage import Header, file_path, file_size, payload_digest, write_file

BLOCK = 16
PROMPT_LEN = 41  # 2 whole blocks stored (32 tokens) before the last prompt token
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
MIB = 2**20


def _prompts(n: int) -> list[dict]:
    """``n`` distinct prompts (distinct first tokens: distinct files)."""
    return [{"prompt_token_ids": [3 + i, *range(10, 10 + PROMPT_LEN - 1)]} for i in range(n)]


def _run(engine: LLM, prompts: list[dict], params: SamplingParams = PARAMS) -> list:
    try:
        return engine.generate(prompts, params, use_tqdm=False)
    finally:
        engine.shutdown()


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))


def _fake_file(folder: str, key: str, payload_bytes: int) -> tuple[str, Header, bytes]:
    payload = bytes(payload_bytes)
    header = Header("id", 4, 1, 2, [1, 1], "torch.float32", len(payload), payload_digest(payload))
    return file_path(folder, key), header, payload


def _save(
    budget: DiskBudget, folder: str, key: str, payload_bytes: int, mtime_ns: int | None = None
) -> bool:
    """The worker's save (``SharedStorageWorker._save``), its mtime set when given."""
    path, header, payload = _fake_file(folder, key, payload_bytes)
    if not budget.admit(path, file_size(header)):
        return False
    write_file(path, header, payload)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    budget.written(path)
    return True


def _key(i: int) -> str:
    return f"{i:040x}"


def test_many_distinct_files_stay_under_the_cap_oldest_evicted_first(tmp_path):
    folder = str(tmp_path)
    one = file_size(_fake_file(folder, _key(0), 4096)[1])
    budget = DiskBudget(folder, 3.5 * one / 2**30)  # room for 3 files
    for i in range(20):
        assert _save(budget, folder, _key(i), 4096)
        assert _folder_bytes(folder) <= budget.stats.cap_bytes
        assert _folder_bytes(folder) == budget.stats.stored_bytes
    assert sorted(os.listdir(folder)) == [_key(i) + ".kv" for i in (17, 18, 19)]
    assert (budget.stats.evicted_files, budget.stats.evicted_bytes) == (17, 17 * one)


def test_a_file_a_reader_touched_is_evicted_after_the_untouched_ones(tmp_path):
    folder = str(tmp_path)
    one = file_size(_fake_file(folder, _key(0), 4096)[1])
    budget = DiskBudget(folder, 3.5 * one / 2**30)
    for i in range(3):
        _save(budget, folder, _key(i), 4096, mtime_ns=10**18 + i)
    # a consumer loaded the oldest file since (disk_budget.touch): it is young again
    os.utime(file_path(folder, _key(0)), ns=(10**18 + 9, 10**18 + 9))
    _save(budget, folder, _key(3), 4096)
    assert sorted(os.listdir(folder)) == [_key(i) + ".kv" for i in (0, 2, 3)]


def test_a_file_over_the_cap_alone_is_not_written_and_counted(tmp_path, caplog):
    folder = str(tmp_path)
    budget = DiskBudget(folder, 8192 / 2**30)
    assert _save(budget, folder, _key(0), 4096)
    with caplog.at_level(logging.INFO, logger="trillm.kv_transfer"):
        assert not _save(budget, folder, _key(1), 8192)
    assert os.listdir(folder) == [_key(0) + ".kv"]  # nothing evicted for it either
    assert budget.stats.too_large == 1
    assert "1 over the cap not written" in caplog.text


def test_a_restart_counts_the_files_there_and_evicts_down_to_the_cap(tmp_path):
    folder = str(tmp_path)
    for i in range(5):
        path, header, payload = _fake_file(folder, _key(i), 4096)
        write_file(path, header, payload)
        os.utime(path, ns=(10**18 + i, 10**18 + i))
    (tmp_path / "notes.kv").write_bytes(bytes(10**6))  # not a KV file: never counted nor removed
    one = file_size(_fake_file(folder, _key(0), 4096)[1])
    budget = DiskBudget(folder, 2.5 * one / 2**30)
    assert sorted(os.listdir(folder)) == [_key(3) + ".kv", _key(4) + ".kv", "notes.kv"]
    assert budget.stats.stored_bytes == 2 * one


def test_a_producer_serving_many_distinct_prompts_stays_under_the_cap(
    tiny_model_factory, tmp_path, caplog
):
    path = tiny_model_factory("qwen2")
    probe = str(tmp_path / "probe")
    _run(kv_engine(path, kv_transfer_config=shared_storage_kv("kv_producer", probe)), _prompts(1))
    (one,) = (os.path.getsize(os.path.join(probe, name)) for name in os.listdir(probe))
    folder = str(tmp_path / "capped")
    cap_gib = 2.5 * one / 2**30
    with caplog.at_level(logging.INFO, logger="trillm.kv_transfer"):
        _run(
            kv_engine(
                path,
                kv_transfer_config=shared_storage_kv(
                    "kv_producer", folder, max_local_disk_size=cap_gib
                ),
            ),
            _prompts(8),
        )
    assert len(os.listdir(folder)) == 2
    assert _folder_bytes(folder) <= cap_gib * 2**30
    assert "evicted 1 files" in caplog.text  # the first eviction's log line


def test_a_consumer_whose_file_is_evicted_after_the_lookup_recomputes(
    tiny_model_factory, tmp_path, monkeypatch
):
    """The producer evicts the file between the consumer scheduler's lookup (header found)
    and its worker's load: the load fails, the request is recomputed, output = plain engine."""
    path = tiny_model_factory("qwen2")
    folder = str(tmp_path)
    prompts = _prompts(3)
    plain = _run(kv_engine(path), prompts)
    _run(
        kv_engine(path, kv_transfer_config=shared_storage_kv("kv_producer", folder)),
        prompts,
        SamplingParams(max_tokens=1),
    )
    stored = os.listdir(folder)
    written_at = {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in stored}
    producer = DiskBudget(folder, _folder_bytes(folder) / 2**30)  # full: a new file evicts one
    load = shared_storage.SharedStorageWorker._load

    def evicted_then_load(self, item, kv_caches):
        if len(os.listdir(folder)) == len(stored):  # the step's first load: the producer saves
            producer.admit(file_path(folder, _key(99)), 1)
        return load(self, item, kv_caches)

    monkeypatch.setattr(shared_storage.SharedStorageWorker, "_load", evicted_then_load)
    outs = _run(
        kv_engine(path, kv_transfer_config=shared_storage_kv("kv_consumer", folder)), prompts
    )
    assert len(os.listdir(folder)) == len(stored) - 1 == 2
    for name in os.listdir(folder):  # loaded: touched, young again for the producer's LRU
        assert os.stat(os.path.join(folder, name)).st_mtime_ns > written_at[name]
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain]
    assert sorted(o.num_cached_tokens for o in outs) == [0, 32, 32]
    diff = max(
        abs(x[t].logprob - y[t].logprob)
        for a, b in zip(outs, plain, strict=True)
        for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids)
    )
    assert diff < 1e-4


@pytest.mark.parametrize(
    ("cap", "role", "message"),
    [
        ("1GB", "kv_producer", "must be a number of GiB, got '1GB'"),
        (True, "kv_both", "must be a number of GiB, got True"),
        (math.nan, "kv_producer", "must be a number of GiB, got nan"),
        (math.inf, "kv_producer", "must be a number of GiB, got inf"),
        (0, "kv_producer", "must be > 0 GiB, got 0"),
        (-1.5, "kv_both", "must be > 0 GiB, got -1.5"),
        (1, "kv_consumer", "a kv_consumer writes no file"),
    ],
)
def test_a_bad_cap_is_refused_naming_the_key(cap, role, message):
    with pytest.raises(ValueError, match="kv_connector_extra_config.max_local_disk_size") as err:
        parse_kv_transfer_config(shared_storage_kv(role, "/tmp/x", max_local_disk_size=cap))
    assert message in str(err.value)


def test_the_cap_is_taken_in_gib():
    kv = parse_kv_transfer_config(shared_storage_kv("kv_producer", "/tmp/x", max_local_disk_size=2))
    assert kv is not None and kv.max_local_disk_size == 2.0
