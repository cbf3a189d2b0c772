"""The shared-storage KV connector and the KV offload tier under tensor and pipeline
parallelism: each rank saves and loads its own share of a prompt's KV (its KV heads, its
stage's layers) as its own file or tier rows; a prompt loads only when every rank's share is
there, and a load that fails on one rank is recomputed on all of them. Greedy tokens equal the
one-rank engine without a connector and transformers'; vLLM's external_prefix_cache_hits and
prompt_tokens_by_source count the moved tokens."""

from __future__ import annotations

import os
import re
import shutil

import pytest
from hf_reference import hf_greedy
from kv_connectors import aligned, kv_engine, max_logprob_diff, shared_storage_kv

from trillm import LLM, SamplingParams
from trillm.kv_transfer.disk_budget import DiskBudget, rank_share
from trillm.kv_transfer.storage import HEADER_READ_BYTES

LENGTHS = (40, 70, 9)  # 2, 4 and 0 whole blocks before the last prompt token
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
RANK_FILE = re.compile(r"^[0-9a-f]{40}\.r(\d)\.kv$")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts() -> list[list[int]]:
    return [list(range(5 + i, 5 + i + n)) for i, n in enumerate(LENGTHS)]


def _run(engine: LLM, params: SamplingParams = PARAMS) -> tuple[list, object]:
    try:
        outs = engine.generate(
            [{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False
        )
        return outs, engine.engine.get_stats()
    finally:
        engine.shutdown()


def _tokens(outs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_model_factory):
    """(model path, the one-rank engine's outputs without a connector)."""
    path = tiny_model_factory("qwen2")
    return path, _run(kv_engine(path))[0]


def _store(path: str, folder: str, tp: int, pp: int) -> None:
    _run(
        kv_engine(path, tp, pp, kv_transfer_config=shared_storage_kv("kv_producer", folder)),
        SamplingParams(max_tokens=1),
    )


@pytest.fixture(scope="module")
def stored_tp2(plain, tmp_path_factory):
    """The folder a tensor-parallel (2 ranks) producer filled."""
    folder = str(tmp_path_factory.mktemp("kv-tp2"))
    _store(plain[0], folder, 2, 1)
    return folder


def _files_of(folder: str, num_tokens: int) -> dict[int, str]:
    """rank -> the path of its file of the prompt with ``num_tokens`` stored tokens."""
    found = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            if f'"num_tokens": {num_tokens},'.encode() in f.read(HEADER_READ_BYTES):
                found[int(RANK_FILE.match(name).group(1))] = os.path.join(folder, name)
    return found


def _consume(path: str, folder: str, tp: int, pp: int, plain_outs: list) -> tuple[list, object]:
    """A consumer's outputs and stats, its tokens checked against the plain engine's."""
    outs, stats = _run(
        kv_engine(path, tp, pp, kv_transfer_config=shared_storage_kv("kv_consumer", folder))
    )
    assert _tokens(outs) == _tokens(plain_outs)
    assert max_logprob_diff(outs, plain_outs) < 1e-3
    return outs, stats


def test_each_rank_writes_its_own_file_of_each_prompt(stored_tp2):
    names = os.listdir(stored_tp2)
    assert all(RANK_FILE.match(n) for n in names), names
    stems = {n.split(".")[0] for n in names}
    assert len(stems) == sum(1 for n in LENGTHS if aligned(n) > 0)
    assert sorted(names) == sorted(f"{s}.r{r}.kv" for s in stems for r in (0, 1))


def test_a_tp2_consumer_loads_every_ranks_share_and_matches(plain, stored_tp2):
    path, plain_outs = plain
    outs, stats = _consume(path, stored_tp2, 2, 1, plain_outs)
    for prompt, out in zip(_prompts(), outs, strict=True):
        assert out.num_cached_tokens == aligned(len(prompt))
        assert list(out.outputs[0].token_ids) == hf_greedy(path, prompt, PARAMS.max_tokens)
    moved = sum(aligned(n) for n in LENGTHS)
    assert stats.external_prefix_cache_hits == moved
    assert stats.prompt_tokens_by_source["external_kv_transfer"] == moved
    assert stats.prompt_tokens_by_source["local_compute"] == sum(LENGTHS) - moved


def test_a_missing_rank_file_recomputes_the_whole_prompt(plain, stored_tp2, tmp_path):
    path, plain_outs = plain
    folder = str(tmp_path / "kv")
    shutil.copytree(stored_tp2, folder)
    os.unlink(_files_of(folder, aligned(LENGTHS[0]))[1])  # rank 0's file stays
    outs, stats = _consume(path, folder, 2, 1, plain_outs)
    assert [o.num_cached_tokens for o in outs] == [0, aligned(LENGTHS[1]), 0]
    assert stats.external_prefix_cache_hits == aligned(LENGTHS[1])


def test_a_load_failing_on_one_rank_is_recomputed_on_every_rank(plain, stored_tp2, tmp_path):
    """Rank 1's payload damaged in place (its header and size intact): the scheduler finds
    both files, rank 0 loads its share, rank 1's digest check fails; both ranks leave the
    request out of the step and it is computed, never run on rank 0's loaded share alone."""
    path, plain_outs = plain
    folder = str(tmp_path / "kv")
    shutil.copytree(stored_tp2, folder)
    with open(_files_of(folder, aligned(LENGTHS[0]))[1], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    outs, stats = _consume(path, folder, 2, 1, plain_outs)
    assert [o.num_cached_tokens for o in outs] == [0, aligned(LENGTHS[1]), 0]
    assert stats.external_prefix_cache_hits == aligned(LENGTHS[1])
    assert stats.prompt_tokens_by_source["external_kv_transfer"] == aligned(LENGTHS[1])


def test_a_pp2_producer_and_consumer_match(plain, tmp_path):
    path, plain_outs = plain
    folder = str(tmp_path / "kv")
    _store(path, folder, 1, 2)
    assert {RANK_FILE.match(n).group(1) for n in os.listdir(folder)} == {"0", "1"}
    outs, stats = _consume(path, folder, 1, 2, plain_outs)
    assert [o.num_cached_tokens for o in outs] == [aligned(n) for n in LENGTHS]
    assert stats.external_prefix_cache_hits == sum(aligned(n) for n in LENGTHS)


def test_one_rank_finds_no_file_of_two_ranks(plain, stored_tp2):
    path, plain_outs = plain
    outs, stats = _consume(path, stored_tp2, 1, 1, plain_outs)
    assert stats.external_prefix_cache_hits == 0


def test_each_ranks_disk_budget_counts_its_own_files_under_its_share(tmp_path):
    assert rank_share(2, 1, 2) == 0.25  # stage of 1 of 2 layers, 2 tensor-parallel ranks
    assert rank_share(3, 2, 1) == pytest.approx(2 / 3)
    key = "ab" * 20
    for rank, size in ((0, 100), (1, 300)):
        (tmp_path / f"{key}.r{rank}.kv").write_bytes(b"x" * size)
    (tmp_path / f"{key}.kv").write_bytes(b"x" * 1000)  # a one-rank engine's
    budget = DiskBudget(str(tmp_path), 2000 / 2**30, ".r1.kv", share=0.5)
    assert (budget.stats.stored_bytes, budget.stats.stored_files) == (300, 1)
    assert budget.stats.cap_bytes == 1000
