"""gpt-oss under pipeline parallelism: PP=2 greedy tokens equal the single-rank engine's
(which equals transformers: tests/models/test_gpt_oss.py), the sliding-window layer on one
stage and the full-attention one on the other, each with its sinks and experts; tensor
parallelism is refused by name before any worker starts (its sinks and interleaved experts are
not split yet)."""

from __future__ import annotations

import pytest
from parallel_reference import greedy, reference_tokens

from trillm.engine.llm import LLM

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 8
LIMITS = {"max_model_len": 64, "kv_cache_memory": "4MiB"}


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_factory):
    return tiny_model_factory("gpt_oss", num_hidden_layers=2)  # sliding, then full


def test_pp2_matches_pp1(gpt_oss):
    reference = reference_tokens(gpt_oss, PROMPTS, MAX_TOKENS, **LIMITS)
    assert all(len(set(t)) > 1 for t in reference), reference  # not a repeated token
    with LLM(gpt_oss, **LIMITS, pipeline_parallel_size=2) as llm:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference


def test_tp2_is_refused_by_name(gpt_oss):
    match = "tensor_parallel_size=2: tensor parallelism does not support GptOssForCausalLM"
    with pytest.raises(ValueError, match=match):
        LLM(gpt_oss, **LIMITS, tensor_parallel_size=2)
