"""Tensor and pipeline parallelism on every supported architecture (issue 14): TP=2 and PP=2
greedy tokens equal the single-rank ("uni") engine's, token for token, on each family that
tests/parallel/test_tensor_parallel.py (Llama) and tests/parallel/test_pipeline_parallel.py (Llama, Gemma 2) do
not already cover (every registered architecture); expert sizes TP does not divide are
refused at startup, and fused expert tensors shard as per-expert ones do. GPT-NeoX and Qwen2
get random biases, so that a row-parallel bias added on every rank (not once) changes the
tokens.

Every model has 2 layers (PP=2 puts one on each stage; Qwen2-MoE's sparse layer 0 and its
dense ``mlp_only_layers`` layer 1 land on different stages), 4 query heads and 2 KV heads (one
per rank under TP=2; GPT-NeoX has 4; OLMo 2 has 1, replicated on both ranks, so that its k norm
over all KV heads spans a replicated head; Phi-3's checkpoint fuses q/k/v and gate/up), and a
vocabulary of 4096 (an even split). Gemma 2 and 3 get a smaller weight scale: with the default
one their greedy tokens repeat the prompt's last token, which would hide a wrong shard (each
reference is checked for that). An engine start costs seconds on 2 cores, so each family runs
one TP=2 and one PP=2 engine, 3 prompts x 8 tokens. TP=2 x PP=2 through the Python API, and
every layout over HTTP, are in files of their own; tests/parallel/test_parallel_architectures_http.py's
docstring tables where each (layout, interface) of the matrix is tested.
"""

from __future__ import annotations

import pytest
import torch
from parallel_models import LIMITS, MAX_TOKENS, PROMPTS
from parallel_reference import greedy, reference_tokens
from safetensors.torch import load_file

from trillm.engine.llm import LLM

# Families with a tensor-parallel split (trillm.distributed.sharding.ARCHITECTURES), Llama aside.
TP_ARCHES = [
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "gpt_neox",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
]
# Every family but Llama and Gemma 2 (tests/parallel/test_pipeline_parallel.py).
PP_ARCHES = [
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma3",
    "phi3",
    "olmo2",
    "gpt_neox",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
]


def parallel_tokens(path: str, **parallel: int) -> list[list[int]]:
    with LLM(path, **LIMITS, **parallel) as llm:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference(path: str) -> list[list[int]]:
    tokens = reference_tokens(path, PROMPTS, MAX_TOKENS, **LIMITS)
    # A reference that only repeats one token per prompt could not tell a wrong shard apart.
    assert all(len(set(t)) > 1 for t in tokens), tokens
    return tokens


@pytest.mark.parametrize("arch", TP_ARCHES)
def test_tp2_matches_tp1(model, arch):
    path = model(arch)
    assert parallel_tokens(path, tensor_parallel_size=2) == reference(path)


@pytest.mark.parametrize("arch", PP_ARCHES)
def test_pp2_matches_pp1(model, arch):
    path = model(arch)
    assert parallel_tokens(path, pipeline_parallel_size=2) == reference(path)


def test_tp_size_that_does_not_divide_an_expert_size_is_refused(tiny_model_factory):
    """Refused before any worker starts, naming the size it does not divide."""
    path = tiny_model_factory(
        "qwen2_moe",
        num_hidden_layers=1,
        moe_intermediate_size=50,
        shared_expert_intermediate_size=81,
    )
    match = r"tensor_parallel_size=2 does not divide .*shared_expert_intermediate_size=81"
    with pytest.raises(ValueError, match=match):
        LLM(path, tensor_parallel_size=2, **LIMITS)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide .*=50"):
        LLM(path, tensor_parallel_size=4, **LIMITS)


def test_fused_expert_tensors_shard_like_the_per_expert_ones(model):
    """Checkpoints that fuse the experts (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]) give each rank the same rows and columns as the per-expert
    names: the rank's gate rows, then its up rows; its down columns."""
    from trillm.config import EngineArgs
    from trillm.distributed.sharding import RankShapes
    from trillm.model_executor.loader import safetensors_files
    from trillm.model_executor.model_config import load_model_config
    from trillm.model_executor.models.moe import num_experts

    path = model("qwen3_moe")
    cfg = load_model_config(EngineArgs(path))
    whole = load_file(safetensors_files(path)[0])
    experts = "model.layers.0.mlp.experts."
    num = num_experts(cfg.hf_config)
    part = {
        p: torch.stack([whole[f"{experts}{e}.{p}_proj.weight"] for e in range(num)])
        for p in ("gate", "up", "down")
    }
    gate_up = torch.cat([part["gate"], part["up"]], 1)  # [E, 2I, H]
    for rank in (0, 1):
        shapes = RankShapes.of(cfg, rank, 2)
        per_expert = {
            p: torch.stack(
                [
                    shapes.read_shard(
                        cfg, f"{experts}{e}.{p}_proj.weight", whole[f"{experts}{e}.{p}_proj.weight"]
                    )
                    for e in range(num)
                ]
            )
            for p in ("gate", "up", "down")
        }
        fused = shapes.read_shard(cfg, experts + "gate_up_proj", gate_up)
        assert torch.equal(fused, torch.cat([per_expert["gate"], per_expert["up"]], 1))
        down = shapes.read_shard(cfg, experts + "down_proj", part["down"])
        assert torch.equal(down, per_expert["down"]) and down.shape[2] == 16  # I = 32 over 2
