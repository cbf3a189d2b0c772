"""The KV offload tier under tensor and pipeline parallelism, and vLLM's vllm:kv_offload_*
series: each rank keeps its share of every tier block (its KV heads of its stage's layers), the
scheduler side is one per engine core; prefixes evicted from a small KV cache load back with
the one-rank engine's greedy tokens; the series count the bytes the steps moved, each rank's
share one operation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kv_connectors import run_rounds
from prometheus_client import CollectorRegistry, generate_latest
from scheduler_twin_helpers import ecr

from trillm import LLM, SamplingParams
from trillm.config import CacheConfig, EngineArgs, SchedulerConfig
from trillm.engine.config_builder import build_config
from trillm.entrypoints.openai.metrics.kv_offload import KVOffloadCollector
from trillm.kv_transfer.offload import OffloadScheduler
from trillm.kv_transfer.scheduler_side import ConnectorScheduler
from trillm.messages import KVOffloadStats, SchedulerStats

BLOCK = 16
CACHE_BLOCKS = 20  # 320 tokens: one 200-token prompt evicts the blocks of an earlier one
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
A = list(range(10, 110))  # 100 tokens: 6 whole blocks before its last token
B = list(range(200, 400))
C = list(range(400, 560))
A2 = A[:70] + list(range(900, 925))  # A's first 4 blocks, then its own tokens
ROUNDS = ([A], [B, C], [A, A2])  # the last round's prefixes were evicted by the second's
SIZE_GIB = 0.01

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(path: str, tp: int = 1, pp: int = 1, **kwargs) -> LLM:
    return LLM(
        path,
        max_model_len=256,
        num_gpu_blocks_override=CACHE_BLOCKS,
        block_size=BLOCK,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="uni" if tp * pp == 1 else "mp",
        **kwargs,
    )


def _run(engine: LLM) -> tuple[list[list[int]], list[int], SchedulerStats]:
    """(greedy tokens, cached prompt tokens, stats) of ROUNDS, each round one batch."""
    return run_rounds(engine, ROUNDS, PARAMS)


@pytest.fixture(scope="module")
def runs(tiny_model_factory):
    """(model path, the one-rank engine without a tier, the one-rank engine with it)."""
    path = tiny_model_factory("qwen2")
    return path, _run(_engine(path)), _run(_engine(path, kv_offloading_size=SIZE_GIB))


def _block_bytes(path: str, tp: int, pp: int) -> tuple[int, tuple[int, ...]]:
    args = EngineArgs(
        model=path,
        block_size=BLOCK,
        kv_offloading_size=SIZE_GIB,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    offload = build_config(args).kv_offload
    assert offload is not None
    return offload.block_bytes, offload.rank_block_bytes


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_the_tier_of_several_ranks_loads_an_evicted_prefix_and_matches(runs, tp, pp):
    path, (plain, plain_cached, _), (_, one_cached, one) = runs
    tokens, cached, stats = _run(_engine(path, tp, pp, kv_offloading_size=SIZE_GIB))
    assert tokens == plain
    assert plain_cached[3:] == [0, 0]  # the small cache lost A's blocks
    assert cached == one_cached and cached[3:] == [96, 64]  # the tier had them
    assert stats.prompt_tokens_by_source["external_kv_transfer"] == 96 + 64
    # the same tier blocks moved, each rank its share of them: the bytes are the one-rank
    # engine's, each rank's part of a request's transfer one operation
    block_bytes, shares = _block_bytes(path, tp, pp)
    assert sum(shares) == block_bytes and len(shares) == tp * pp
    assert stats.kv_offload is not None and one.kv_offload is not None
    loaded = stats.external_prefix_cache_hits // BLOCK
    assert stats.kv_offload.loads.bytes == loaded * block_bytes == one.kv_offload.loads.bytes
    assert stats.kv_offload.stores.bytes == one.kv_offload.stores.bytes
    assert stats.kv_offload.loads.count == tp * pp * one.kv_offload.loads.count
    # the ranks' copy seconds (vllm:kv_offload_*_time): measured, and only by the tier
    assert stats.kv_offload.loads.seconds > 0 and stats.kv_offload.stores.seconds > 0


def test_the_tier_size_is_over_every_rank(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    whole, (one,) = _block_bytes(path, 1, 1)
    split, shares = _block_bytes(path, 2, 2)
    assert whole == one == split and shares == (whole // 4,) * 4


def test_the_counts_are_the_steps_transfers():
    """Each step's saves and loads (its KVTransferItems' blocks) against the series: bytes
    over both ranks (a block is 100 + 50 bytes), one size observation per rank and request."""
    scheduler = ConnectorScheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=256),
        CacheConfig(block_size=BLOCK),
        64,
        OffloadScheduler(8, BLOCK, (100, 50)),
    )
    stored = 0
    for req_id, tokens in (("a", A[:49]), ("b", B[:33])):
        scheduler.add_request(ecr(req_id, tokens, 1))
        step = scheduler.schedule().kv_connector_step
        assert step is not None and not step.loads
        stored += sum(len(item.block_ids) for item in step.saves)
    stats = scheduler.get_stats().kv_offload
    assert stats is not None
    assert stored == 3 + 2 and stats.stores.bytes == stored * 150
    assert stats.stores.count == 2 * 2  # two requests stored, on two ranks
    assert stats.stores.buckets[0] == stats.stores.count  # all under 1 MB
    assert stats.loads.bytes == stats.loads.count == 0


def test_the_series_carry_vllms_names():
    stats = KVOffloadStats()
    stats.loads.observe([3_000_000, 1_500_000])
    stats.stores.observe([300, 150])
    stats.loads.seconds = 0.25
    engine = SimpleNamespace(get_engine_stats=lambda: [SchedulerStats(kv_offload=stats)])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVOffloadCollector(engine, "m"))
    text = generate_latest(registry).decode()
    assert 'vllm:kv_offload_load_bytes_total{engine="0",model_name="m"} 4.5e+06' in text
    assert 'vllm:kv_offload_store_bytes_total{engine="0",model_name="m"} 450.0' in text
    assert 'vllm:kv_offload_load_size_bucket{engine="0",le="1000000.0",model_name="m"} 0.0' in (
        text
    )
    assert 'vllm:kv_offload_load_size_bucket{engine="0",le="5000000.0",model_name="m"} 2.0' in (
        text
    )
    assert 'vllm:kv_offload_load_size_count{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:kv_offload_load_time_total{engine="0",model_name="m"} 0.25' in text
    assert 'vllm:kv_offload_store_time_total{engine="0",model_name="m"} 0.0' in text
    assert 'transfer_type="CPU_to_GPU"} 0.25' in text  # vllm:kv_offload_total_time_total
    legacy = 'vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type='
    assert legacy + '"CPU_to_GPU"} 4.5e+06' in text
    assert legacy + '"GPU_to_CPU"} 450.0' in text
    assert (
        'vllm:kv_offload_size_count{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 2.0'
        in (text)
    )
    without = SimpleNamespace(get_engine_stats=lambda: [SchedulerStats()])
    assert list(KVOffloadCollector(without, "m").collect()) == []
