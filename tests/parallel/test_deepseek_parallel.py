"""DeepSeek (MLA's latent cache, dense and mixture-of-experts layers) under pipeline
parallelism: PP=2 greedy tokens equal the single-rank engine's (which equals transformers:
tests/models/test_deepseek.py); tensor parallelism is refused by name before any worker
starts (MLA's heads and the latent are not split yet)."""

from __future__ import annotations

import pytest
from parallel_reference import greedy, reference_tokens

from trillm.engine.llm import LLM
from trillm.testing.tiny_deepseek import build_tiny_deepseek

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 8
LIMITS = {"max_model_len": 64, "kv_cache_memory": "4MiB"}


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    # 2 layers: stage 0 holds the dense layer, stage 1 the mixture-of-experts one
    return str(build_tiny_deepseek("v3", tmp_path_factory.mktemp("v3"), num_hidden_layers=2))


def test_pp2_matches_pp1(v3):
    reference = reference_tokens(v3, PROMPTS, MAX_TOKENS, **LIMITS)
    assert all(len(set(t)) > 1 for t in reference), reference  # not a repeated token
    with LLM(v3, **LIMITS, pipeline_parallel_size=2) as llm:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference


def test_tp2_is_refused_by_name(v3):
    with pytest.raises(ValueError, match="tensor_parallel_size=2: tensor parallelism does not"):
        LLM(v3, **LIMITS, tensor_parallel_size=2)
