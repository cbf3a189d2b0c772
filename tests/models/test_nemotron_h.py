"""Nemotron-H (Mamba-2, attention without positions, relu2 MLP and mixture-of-experts layers,
each a pre-norm block of its own) against transformers.

Tiny random checkpoints in fp32 (``hybrid_override_pattern`` ``M*-M``; the Mamba-2 layers'
width and the attention's head_dim both apart from what hidden_size would give; random
biases; and ``M*EM``: 4 relu2 experts in 2 groups, top 2 of the best group, a random
``e_score_correction_bias``, a latent width of 32, a shared MLP): greedy tokens, sample and
prompt logprobs equal transformers' for batched prompts of 2 to 33 tokens (over up to 5 SSD
chunks of 8), whole or in 7-token chunks; through the engine, preempted and chunked, twice. Only the attention layer holds KV blocks, the MLP layer no state
at all. Every ``NemotronHConfig`` field is decided; the layer kinds, the legacy field names
and the refusals are as transformers reads them.
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
from trillm.model_executor import nemotron_h_config
from trillm.model_executor.bamba_config import ATTENTION, MAMBA, BambaConfigError
from trillm.testing.tiny_nemotron_h import MOE, NEMOTRON_H, build_tiny_nemotron_h

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "NemotronHForCausalLM"
MAX_NEW = 10
# Not seed 4: one of its prompt tokens has a logprob 1.9e-6 from another token's, so its rank
# flips on float noise in the chunked run.
PROMPTS = ([5, 19, 2, 33], 5)


CASES = {"dense": {}, "moe": MOE}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}

    def build(case: str):
        if case not in paths:
            path = build_tiny_nemotron_h(tmp_path_factory.mktemp(case), **CASES[case])
            paths[case] = (str(path), load_hf(path))
        return paths[case]

    return build


@pytest.fixture(scope="module")
def built(checkpoints):
    return checkpoints("dense")


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_equal_transformers(checkpoints, case, chunk):
    path, hf = checkpoints(case)
    prompts = random_prompts(*PROMPTS)
    reqs = run_requests(
        make_runner(path), prompts, MAX_NEW, chunk=chunk, logprobs=2, prompt_logprobs=1
    )
    check_logprobs(hf, reqs, MAX_NEW, k_prompt=1, k=2)


def test_engine_preempts_and_chunks(built):
    """Six requests in 16 KV blocks (they need ~25): preempted ones are computed again from a
    zero state; 16-token budgets chunk the prompts across SSD chunks and state hand-overs."""
    path, _ = built
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
        num_gpu_blocks_override=16,
        max_num_batched_tokens=16,
        distributed_executor_backend="uni",
    )
    expected = [hf_greedy(path, p, new) for p in prompts]
    assert first == expected and second == expected
    assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"


def test_only_the_attention_layer_holds_kv_blocks(built):
    """M * - M: two Mamba-2 states (conv over 96 + 2 x 2 x 16 channels, 8 x 12 x 16 SSM
    values), one KV layer, nothing for the MLP layer; prefix caching off."""
    path, _ = built
    runner = make_runner(path)
    layout = runner.ssm_layout
    assert layout is not None
    assert (layout.conv, layout.ssm, layout.num_layers, layout.kv_layers) == (
        (160, 3),
        (8, 12, 16),
        2,
        1,
    )
    assert len(runner.kv_caches) == 1 and len(runner.ssm.conv) == 2
    config = build_config(EngineArgs(model=path, device="cpu", max_model_len=128))
    assert not config.cache.enable_prefix_caching


# ---------------------------------------------------------------- config


def _prepare(**fields):
    hf = {**NEMOTRON_H, "architectures": [ARCH], **fields}
    return nemotron_h_config.prepare(hf, ARCH)


def test_every_transformers_config_field_is_decided():
    from transformers import NemotronHConfig

    fields = {f.name for f in dataclasses.fields(NemotronHConfig)}
    assert fields - set(nemotron_h_config.FIELDS) == set()


@pytest.mark.parametrize(
    "fields",
    [
        {"hybrid_override_pattern": "M-*"},
        {"layers_block_type": ["mamba", "mlp", "attention"]},
        {"layers_block_type": ["full_attention", "linear_attention"], "num_hidden_layers": 5},
    ],
    ids=["pattern", "legacy-names", "list-wins"],
)
def test_layer_kinds_as_transformers_reads_them(fields):
    from transformers import NemotronHConfig

    expected = NemotronHConfig(**{**NEMOTRON_H, **fields}).layers_block_type
    out = _prepare(**fields)
    assert out["layer_types"] == expected
    assert out["num_hidden_layers"] == len(expected)
    assert set(out["layer_types"]) <= {MAMBA, ATTENTION, "mlp"}


def test_legacy_field_names_win_as_in_transformers():
    """transformers takes mamba_n_groups / mamba_d_conv / mamba_chunk_size / mamba_conv_bias /
    mamba_dt_limit over the new names; the Mamba-2 width is heads x head_dim (not expand)."""
    from transformers import NemotronHConfig

    legacy = dict(mamba_n_groups=4, mamba_d_conv=3, mamba_chunk_size=4, mamba_conv_bias=False)
    config = NemotronHConfig(**{**NEMOTRON_H, **legacy})
    out = _prepare(**legacy)
    assert (out["mamba_n_groups"], out["mamba_d_conv"]) == (config.n_groups, config.conv_kernel)
    assert (
        (out["mamba_chunk_size"], out["mamba_conv_bias"])
        == (4, False)
        == (
            config.chunk_size,
            config.use_conv_bias,
        )
    )
    assert (out["mamba_n_heads"], out["mamba_d_head"], out["mamba_d_state"]) == (8, 12, 16)
    assert out["mamba_proj_bias"] is True and out["rms_norm_eps"] == config.layer_norm_epsilon
    assert out["tie_word_embeddings"] is False  # transformers never ties Nemotron-H's head
    aliased = {**MOE, "num_local_experts": 6, "n_group": 3}
    assert (
        _prepare(**aliased)["n_routed_experts"] == 6 == NemotronHConfig(**aliased).n_routed_experts
    )


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
        ({"layers_block_type": ["mamba", "sliding_attention"]}, "layers_block_type"),
        ({**MOE, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({**MOE, "n_group": 3}, "n_group"),
        ({**MOE, "n_group": 4}, "n_group"),  # one expert a group: transformers' top-2 fails
        ({**MOE, "topk_group": 3}, "topk_group"),
        ({"sliding_window": 16}, "sliding_window"),
        ({"time_step_limit": [0.0, 1.0]}, "time_step_limit"),
        ({"mamba_dt_limit": [0.0, 1.0]}, "mamba_dt_limit"),
        ({"n_groups": 3}, "n_groups"),
        ({"mamba_n_groups": 3}, "mamba_n_groups"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ],
)
def test_fields_trillm_would_not_run_as_transformers_are_refused(fields, field):
    with pytest.raises(BambaConfigError, match=f"{ARCH}: {field}="):
        _prepare(**fields)


def test_expert_fields_are_dropped_without_expert_layers():
    """A dense checkpoint's config.json (transformers writes every field) keeps no expert
    sizes for tensor parallelism to check; transformers' default layer list has an 'E'."""
    dense = _prepare(n_routed_experts=8, moe_intermediate_size=7688)
    assert "moe_intermediate_size" not in dense and "n_routed_experts" not in dense
    default = _prepare(hybrid_override_pattern=None)
    assert default["layer_types"] == [MAMBA, "moe", ATTENTION, "mlp"]
    assert default["moe_intermediate_size"] == 7688
