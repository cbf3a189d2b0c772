"""TP=2 x PP=2 through the Python API on every registered architecture but Llama (issue 14;
Llama's: tests/parallel/test_pipeline_parallel.py): ``LLM(path, tensor_parallel_size=2,
pipeline_parallel_size=2)`` (4 ranks: two stages of two tensor-parallel ranks each) gives the
single-rank engine's ("uni") greedy tokens, token for token. The models (2 layers: one per
stage) are tests/parallel/test_parallel_architectures.py's; the whole matrix of layouts is in
tests/parallel/test_parallel_architectures_http.py's docstring. 4 ranks on 2 cores are slow: 2 prompts
x 8 tokens (the HTTP files' prompts, so a worker that runs both computes each reference once).
"""

from __future__ import annotations

import pytest
from parallel_models import ARCHITECTURES, LIMITS, MAX_TOKENS, TWO_PROMPTS
from parallel_reference import greedy, reference_tokens

from trillm.engine.llm import LLM


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tp2_x_pp2_matches_tp1(model, arch):  # noqa: F811
    path = model(arch)
    expected = reference_tokens(path, TWO_PROMPTS, MAX_TOKENS, **LIMITS)
    # A reference that only repeats one token per prompt could not tell a wrong shard apart.
    assert all(len(set(t)) > 1 for t in expected), expected
    with LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **LIMITS) as llm:
        outs = llm.generate(TWO_PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
