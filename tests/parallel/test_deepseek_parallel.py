"""DeepSeek (MLA's latent cache, dense and mixture-of-experts layers) split over ranks: TP=2
and PP=2 greedy tokens equal the single-rank engine's (which equals transformers:
tests/models/test_deepseek.py). Under TP each rank holds its heads' rows of q / q_b and kv_b
and columns of o_proj, every expert's half of its intermediate size and the shared experts'
half, and the whole latent cache (every head reads it); a size that does not divide the
heads is refused before any worker starts."""

from __future__ import annotations

import pytest
from parallel_reference import greedy, reference_tokens

from trillm.engine.llm import LLM
from trillm.testing.tiny_deepseek import build_tiny_deepseek

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 8
LIMITS = {"max_model_len": 64, "kv_cache_memory": "4MiB"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    paths: dict[str, str] = {}

    def get(case: str) -> str:
        # 2 layers: under PP=2 stage 0 holds the dense layer, stage 1 the experts' one
        if case not in paths:
            folder = tmp_path_factory.mktemp(case)
            paths[case] = str(build_tiny_deepseek(case, folder, num_hidden_layers=2))
        return paths[case]

    return get


def parallel_tokens(path: str, **parallel: int) -> list[list[int]]:
    reference = reference_tokens(path, PROMPTS, MAX_TOKENS, **LIMITS)
    assert all(len(set(t)) > 1 for t in reference), reference  # not a repeated token
    with LLM(path, **LIMITS, **parallel) as llm:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("case", ["v2_lite", "v3"])  # q_proj; q-LoRA with noaux_tc
def test_tp2_matches_tp1(tiny, case):
    path = tiny(case)
    expected = reference_tokens(path, PROMPTS, MAX_TOKENS, **LIMITS)
    assert parallel_tokens(path, tensor_parallel_size=2) == expected


def test_pp2_matches_pp1(tiny):
    path = tiny("v3")
    expected = reference_tokens(path, PROMPTS, MAX_TOKENS, **LIMITS)
    assert parallel_tokens(path, pipeline_parallel_size=2) == expected


def test_a_tp_size_that_does_not_divide_the_heads_is_refused(tiny):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        LLM(tiny("v3"), **LIMITS, tensor_parallel_size=3)
