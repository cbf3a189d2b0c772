"""Mixture-of-experts models against transformers: Mixtral, Qwen2-MoE (shared expert, a dense
layer among sparse ones) and Qwen3-MoE, tiny random checkpoints as the hub stores them
(per-expert weights), driven through the real ModelRunner: greedy output equals transformers
token for token (whole prompts and 7-token prefill chunks), logprobs close."""

from __future__ import annotations

import pytest
from runner_harness import (
    check_logprobs,
    load_hf,
    make_runner,
    random_prompts,
    run_requests,
    transformers_greedy,
)

from trillm.model_executor.layers.fused_moe import FusedMoE
from trillm.testing.tiny_models import build_tiny_model

MAX_NEW = 8
PROMPT_LENS = [3, 21, 12, 30]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def case(request, tmp_path_factory):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = load_hf(path)
    reference = [transformers_greedy(hf, p, MAX_NEW)[0] for p in random_prompts(PROMPT_LENS)]
    return request.param, path, hf, reference


def test_the_model_routes_through_fused_experts(case):
    arch, path, _, _ = case
    model = make_runner(path).model
    sparse = [m for m in model.modules() if isinstance(m, FusedMoE)]
    layers = len(model.model.layers)
    assert len(sparse) == (layers - 1 if arch == "qwen2_moe" else layers)  # mlp_only_layers=[1]
    assert all(not m.missing() for m in sparse)


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunk7"])
def test_greedy_matches_transformers(case, chunk):
    _, path, _, reference = case
    reqs = run_requests(make_runner(path), random_prompts(PROMPT_LENS), MAX_NEW, chunk=chunk)
    assert [r.output for r in reqs] == reference


def test_logprobs_match_transformers(case):
    _, path, hf, _ = case
    reqs = run_requests(
        make_runner(path),
        random_prompts([17, 26], seed=11),
        4,
        chunk=7,
        tag="l",
        logprobs=2,
        prompt_logprobs=2,
    )
    check_logprobs(hf, reqs, 4, k_prompt=2, k=2)


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_tiny_model("mixtral", tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.down"):
        make_runner(path)


def test_fp8_quantization_of_an_moe_model_is_refused(case):
    import dataclasses

    from trillm.model_executor.models.moe import MoEForCausalLM
    from trillm.model_executor.quantization import UnsupportedQuantizationError

    _, path, _, _ = case
    runner = make_runner(path)
    cfg = dataclasses.replace(runner.config.model, quantization="fp8")
    with pytest.raises(UnsupportedQuantizationError, match="mixture-of-experts"):
        type(runner.model)(cfg, runner.attn_backend)
    assert isinstance(runner.model, MoEForCausalLM)
