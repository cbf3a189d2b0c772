"""Llama 4 text under pipeline parallelism: PP=2 greedy tokens equal transformers' on the tiny
checkpoint (``trillm/testing/tiny_llama4.py``), its first stage holding a dense and an expert
layer with chunked attention, its second a chunked dense layer and the NoPE expert layer; the
prompts cross the 12-token attention chunks and are prefilled in 10-token pieces."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from parallel_reference import greedy
from runner_harness import random_prompts

from trillm.engine.llm import LLM
from trillm.testing.tiny_llama4 import build_tiny_llama4

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return str(build_tiny_llama4(tmp_path_factory.mktemp("llama4")))


def test_two_stages_match_transformers(llama4):
    prompts = random_prompts([30, 7, 41], seed=2)
    reference = [hf_greedy(llama4, p, MAX_TOKENS) for p in prompts]
    with LLM(
        llama4,
        max_model_len=64,
        kv_cache_memory="4MiB",
        max_num_batched_tokens=10,
        pipeline_parallel_size=2,
    ) as llm:
        batch = [{"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(batch, greedy(MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
