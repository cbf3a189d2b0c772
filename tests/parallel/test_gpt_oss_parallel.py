"""gpt-oss under tensor and pipeline parallelism: TP=2 and PP=2 greedy tokens equal the
single-rank engine's (which equals transformers: tests/models/test_gpt_oss.py). Under TP each
rank holds its query heads' sinks and its share of every expert (gate/up column pairs, down
rows; down's bias once), on a copy with random biases so a bias added on every rank would
show; under PP the sliding-window layer is on one stage and the full-attention one on the
other. TP over an MXFP4 checkpoint is refused by name before any worker starts."""

from __future__ import annotations

import json
import shutil

import pytest
from parallel_reference import greedy, reference_tokens

from trillm.engine.llm import LLM

PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4 5"]
MAX_TOKENS = 8
LIMITS = {"max_model_len": 64, "kv_cache_memory": "4MiB"}


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_factory):
    return tiny_model_factory("gpt_oss", num_hidden_layers=2)  # sliding, then full


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_two_ranks_match_one(gpt_oss, layout):
    reference = reference_tokens(gpt_oss, PROMPTS, MAX_TOKENS, **LIMITS)
    assert all(len(set(t)) > 1 for t in reference), reference  # not a repeated token
    with LLM(gpt_oss, **LIMITS, **{layout: 2}) as llm:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference


def test_tp2_over_an_mxfp4_checkpoint_is_refused_by_name(gpt_oss, tmp_path):
    path = tmp_path / "mxfp4"
    shutil.copytree(gpt_oss, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tensor parallelism over MXFP4 checkpoints of GptOss"):
        LLM(str(path), **LIMITS, tensor_parallel_size=2)
