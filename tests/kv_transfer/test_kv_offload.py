"""The KV offload tier (vLLM's ``--kv-offloading-size`` / ``--kv-offloading-backend``): a prefix
evicted from a small KV cache by other traffic, or by a preemption, loads from the tier instead
of being computed again, with the same greedy tokens and log-probs as an engine without the
tier (and transformers' tokens); the tier is bounded, least recently used first; and what it
cannot take is refused by name."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from kv_connectors import max_logprob_diff
from scheduler_twin_helpers import ecr

from trillm import LLM, SamplingParams
from trillm.config import CacheConfig, EngineArgs, SchedulerConfig
from trillm.core.request import Request
from trillm.engine.config_builder import build_config
from trillm.entrypoints.cli.main import build_parser
from trillm.entrypoints.cli.serve_args import engine_kwargs
from trillm.entrypoints.openai.metrics.prometheus import prompt_tokens_by_source
from trillm.kv_transfer.offload import OffloadScheduler, OffloadTier
from trillm.kv_transfer.scheduler_side import ConnectorScheduler
from trillm.messages import FinishReason, SchedulerStats

BLOCK = 16
CACHE_BLOCKS = 20  # 320 tokens: one 200-token prompt evicts the blocks of an earlier one
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
A = list(range(10, 110))  # 100 tokens: 6 whole blocks before its last token
B = list(range(200, 400))
C = list(range(400, 560))
A2 = A[:70] + list(range(900, 925))  # A's first 4 blocks, then its own tokens
D = list(range(600, 637))
ROUNDS = ([A], [B, C], [A, A2, D])  # the last round's prefixes were evicted by the second's

SHARED = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(path: str, executor: str = "uni", **kwargs) -> LLM:
    return LLM(
        path,
        max_model_len=256,
        num_gpu_blocks_override=CACHE_BLOCKS,
        block_size=BLOCK,
        distributed_executor_backend=executor,
        **kwargs,
    )


def _run(engine: LLM, rounds=ROUNDS, params: SamplingParams = PARAMS) -> tuple[list, object]:
    """Each round's prompts as one batch, in turn -> (the outputs in order, the stats)."""
    try:
        outs = []
        for prompts in rounds:
            batch = [{"prompt_token_ids": p} for p in prompts]
            outs += engine.generate(batch, params, use_tqdm=False)
        return outs, engine.engine.get_stats()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    """(model path, the plain engine's outputs of ROUNDS)."""
    path = tiny_model_factory("qwen2")
    return path, _run(_engine(path))[0]


@pytest.mark.parametrize("chunk", [None, 7])
def test_an_evicted_prefix_loads_from_the_tier_and_matches(model, chunk):
    path, plain = model
    extra = {} if chunk is None else {"long_prefill_token_threshold": chunk}
    outs, stats = _run(_engine(path, kv_offloading_size=0.01, **extra))
    assert [o.outputs[0].token_ids for o in outs] == [p.outputs[0].token_ids for p in plain]
    for prompt, out in zip((A, A2, D), outs[3:]):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, PARAMS.max_tokens)
    # the plain engine's small cache lost A's blocks; the tier had them (A2 shares 4)
    assert [p.num_cached_tokens for p in plain[3:5]] == [0, 0]
    assert [o.num_cached_tokens for o in outs[3:5]] == [96, 64]
    # loads (a request preempted after its load may load again); each prompt counts once
    assert stats.external_prefix_cache_hits >= 96 + 64
    sources = stats.prompt_tokens_by_source
    assert sources["external_kv_transfer"] == 96 + 64
    total = sum(len(p) for round_ in ROUNDS for p in round_)
    assert sources["local_compute"] + sources["local_cache_hit"] == total - 96 - 64
    assert max_logprob_diff(outs, plain) < 1e-4


def test_a_preempted_request_loads_its_blocks_from_the_tier(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, logprobs=0)
    rounds = ([A, A2],)  # 100 + 95 prompt tokens growing by 120 each: 20 blocks run out
    plain, plain_stats = _run(_engine(path), rounds, params)
    # a worker process: the steps' loads and saves cross the ring (codec)
    outs, stats = _run(_engine(path, "mp", kv_offloading_size=0.01), rounds, params)
    assert plain_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [p.outputs[0].token_ids for p in plain]
    assert stats.external_prefix_cache_hits > 0  # the preempted one's blocks came back
    assert max_logprob_diff(outs, plain) < 1e-4


def test_the_tier_holds_its_size_and_drops_the_least_recently_used():
    tier = OffloadTier(2)
    first, second = tier.put(1, (1,)), tier.put(2, (2,))
    tier.touch(1)  # 2 is now the least recently used
    assert tier.put(3, (3,)) == second
    assert len(tier) == 2
    assert tier.find(2, (2,)) is None and tier.find(1, (1,)) == first
    assert tier.find(1, (9,)) is None  # the same hash with other tokens: no hit


def test_the_scheduler_stores_each_computed_block_once_and_evicts_the_oldest():
    """A 3-block tier; prompts of 3 and 2 whole blocks: the first prompt's two oldest blocks
    make room for the second's."""
    scheduler = ConnectorScheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=256),
        CacheConfig(block_size=BLOCK),
        64,
        OffloadScheduler(3, BLOCK),
    )
    saved = []
    for req_id, tokens in (("a", A[:49]), ("b", B[:33])):
        scheduler.add_request(ecr(req_id, tokens, 1))
        out = scheduler.schedule()
        assert out.kv_connector_step is not None
        saved += [(s.req_id, len(s.offload_blocks)) for s in out.kv_connector_step.saves]
        scheduler.finish_requests(req_id, FinishReason.ABORT)
    assert saved == [("a", 3), ("b", 2)]
    connector = scheduler.kv_connector
    assert isinstance(connector, OffloadScheduler) and len(connector.tier) == 3
    again = Request.from_engine_core_request(ecr("c", A[:49], 1))
    assert connector.get_num_new_matched_tokens(again, 0) == 0  # its first block was dropped
    assert connector.get_num_new_matched_tokens(again, 2 * BLOCK) == BLOCK  # its third stayed
    b_again = Request.from_engine_core_request(ecr("d", B[:33], 1))
    assert connector.get_num_new_matched_tokens(b_again, 0) == 2 * BLOCK


def test_the_flags_reach_the_engine_args():
    argv = ["serve", "--kv-offloading-size", "2.5", "--kv-offloading-backend", "native"]
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert (kwargs["kv_offloading_size"], kwargs["kv_offloading_backend"]) == (2.5, "native")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kv_offloading_backend": "lmcache"}, "kv_offloading_backend 'lmcache' is not"),
        ({"kv_offloading_size": 0}, "kv_offloading_size must be positive"),
        ({"kv_offloading_size": 1e-9}, "holds no KV block"),
        ({"kv_transfer_config": SHARED}, "kv_offloading_size with kv_transfer_config"),
        ({"data_parallel_size": 2}, "kv_offloading_size with data_parallel_size > 1"),
    ],
)
def test_what_the_tier_cannot_take_is_refused_by_name(tiny_model_factory, extra, message):
    args = {"kv_offloading_size": 0.01, **extra}
    with pytest.raises(ValueError, match=message):
        build_config(EngineArgs(model=tiny_model_factory("qwen2"), **args))


def test_prompt_tokens_by_source_is_vllms_series():
    counts = {"local_compute": 8, "local_cache_hit": 0, "external_kv_transfer": 96}
    family = prompt_tokens_by_source([(["m", "0"], SchedulerStats(prompt_tokens_by_source=counts))])
    assert family.name == "vllm:prompt_tokens_by_source"
    samples = {s.labels["source"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert samples == counts
