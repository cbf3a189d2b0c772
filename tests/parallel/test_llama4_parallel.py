"""Llama 4 text under tensor and pipeline parallelism: TP=2 and PP=2 greedy tokens equal
transformers' on the tiny checkpoint (``trillm/testing/tiny_llama4.py``). Under TP each rank
holds half the heads and half of every MLP's intermediate size, each expert's and the shared
expert's included (the routed sum all-reduced beside the shared expert's); a copy with biased
projections checks that o_proj's bias is added once. Under PP the first stage holds a dense
and an expert layer with chunked attention, the second a chunked dense layer and the NoPE
expert layer. The prompts cross the 12-token attention chunks, prefilled in 10-token pieces."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from parallel_reference import greedy
from runner_harness import random_prompts

from trillm.engine.llm import LLM
from trillm.testing.tiny_llama4 import build_tiny_llama4

MAX_TOKENS = 8
BIASED = {"attention_bias": True, "no_rope_layers": [0, 1, 0, 1], "moe_layers": [0]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "plain": str(build_tiny_llama4(tmp_path_factory.mktemp("llama4"))),
        "biased": str(build_tiny_llama4(tmp_path_factory.mktemp("biased"), seed=1, **BIASED)),
    }


@pytest.mark.parametrize(
    ("checkpoint", "layout"),
    [
        ("plain", "tensor_parallel_size"),
        ("biased", "tensor_parallel_size"),
        ("plain", "pipeline_parallel_size"),
    ],
)
def test_two_ranks_match_transformers(checkpoints, checkpoint, layout):
    path = checkpoints[checkpoint]
    prompts = random_prompts([30, 7, 41], seed=2)
    reference = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    with LLM(
        path,
        max_model_len=64,
        kv_cache_memory="4MiB",
        max_num_batched_tokens=10,
        **{layout: 2},
    ) as llm:
        batch = [{"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(batch, greedy(MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
