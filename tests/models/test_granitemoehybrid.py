"""GraniteMoeHybrid (Granite 4.0-H: Mamba-2 and attention layers, each followed by routed
experts plus a shared MLP, with Granite's multipliers) against transformers.

Tiny random checkpoints in fp32 with the Mamba-2 shapes of ``test_hybrid_ssm.py``'s Bamba:
one with RoPE and 4 experts (top 2), embedding / residual / attention multipliers and a logits
scale away from 1, one without RoPE and without experts (the shared MLP alone). Greedy tokens,
sample and prompt logprobs equal transformers' for batched prompts over several SSD chunks,
whole or in 7-token chunks; through the engine, preempted and chunked, twice.
"""

from __future__ import annotations

import dataclasses

import pytest
from engine_waves import two_waves
from hf_reference import hf_greedy
from runner_harness import check_logprobs, load_hf, make_runner, random_prompts, run_requests

from trillm import SamplingParams
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.model_executor import granitemoehybrid_config
from trillm.model_executor.bamba_config import ATTENTION, MAMBA, BambaConfigError
from trillm.testing.tiny_bamba import GRANITE, build_tiny_granite_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "GraniteMoeHybridForCausalLM"
MAX_NEW = 10
CASES = {
    "rope_moe": {},
    "nope_dense": dict(position_embedding_type=None, num_local_experts=0),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    paths = {}

    def build(case: str):
        if case not in paths:
            path = build_tiny_granite_hybrid(tmp_path_factory.mktemp(case), **CASES[case])
            paths[case] = (str(path), load_hf(path))
        return paths[case]

    return build


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_equal_transformers(built, case, chunk):
    path, hf = built(case)
    prompts = random_prompts([5, 19, 2, 33], seed=4)
    reqs = run_requests(
        make_runner(path), prompts, MAX_NEW, chunk=chunk, logprobs=2, prompt_logprobs=1
    )
    check_logprobs(hf, reqs, MAX_NEW, k_prompt=1, k=2)


def test_engine_preempts_and_chunks(built):
    path, _ = built("rope_moe")
    prompts = random_prompts([40, 9, 33, 25, 17, 30], seed=3)
    new = 2 * MAX_NEW
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    first, second, stats = two_waves(
        path,
        prompts,
        params,
        dtype="float32",
        max_model_len=128,
        block_size=8,
        num_gpu_blocks_override=16,  # 6 requests need ~25 blocks: forces preemption
        max_num_batched_tokens=16,  # long prompts are chunked
        distributed_executor_backend="uni",
    )
    expected = [hf_greedy(path, p, new) for p in prompts]
    assert first == expected and second == expected
    assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"


def test_only_the_attention_layer_holds_kv_blocks(built):
    path, _ = built("rope_moe")
    runner = make_runner(path)
    assert runner.ssm_layout is not None
    assert (runner.ssm_layout.num_layers, runner.ssm_layout.kv_layers) == (2, 1)
    assert len(runner.kv_caches) == 1 and len(runner.ssm.conv) == 2
    config = build_config(EngineArgs(model=path, device="cpu", max_model_len=128))
    assert not config.cache.enable_prefix_caching


# ---------------------------------------------------------------- config


def test_every_transformers_config_field_is_decided():
    from transformers import GraniteMoeHybridConfig

    fields = {f.name for f in dataclasses.fields(GraniteMoeHybridConfig)}
    assert fields - set(granitemoehybrid_config.FIELDS) == set()


def test_layer_types_as_transformers_reads_them():
    """Legacy names remapped, all Mamba-2 when absent; the rope fields dropped without rope."""
    from transformers import GraniteMoeHybridConfig

    hf = {**GRANITE, "architectures": [ARCH], "layer_types": ["attention", "mamba", "mamba"]}
    out = granitemoehybrid_config.prepare(hf, ARCH)
    assert out["layer_types"] == [ATTENTION, MAMBA, MAMBA]
    assert out["layer_types"] == GraniteMoeHybridConfig(**hf).layer_types
    del hf["layer_types"]
    hf["position_embedding_type"] = None
    hf["rope_parameters"] = {"rope_type": "unknown-but-unused"}
    out = granitemoehybrid_config.prepare(hf, ARCH)
    assert out["layer_types"] == [MAMBA] * 3 and "rope_parameters" not in out


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layer_types", ["mamba", "sliding_attention", "mamba"]),
        ("layer_types", ["mamba"]),
        ("num_experts_per_tok", 5),
        ("time_step_limit", [0.0, 1.0]),
        ("mamba_n_groups", 3),
    ],
)
def test_fields_trillm_would_not_run_as_transformers_are_refused(field, value):
    hf = {**GRANITE, "architectures": [ARCH], field: value}
    with pytest.raises(BambaConfigError, match=f"{ARCH}: {field}="):
        granitemoehybrid_config.prepare(hf, ARCH)
