"""Llama 4 with images (``Llama4ForConditionalGeneration``) under pipeline and tensor
parallelism. PP=2: the vision model and projector are read, built and run on the first
stage only, beside the token embeddings that give the separators' rows; the second stage
gets the hidden states (its chunked-attention and MoE layers as the text model's). TP=2:
the vision model is whole on every rank (its q/k/v/o_proj and fc1/fc2 names are ones the
text split would otherwise cut); the experts split as the text model's. Both give the
one-rank engine's greedy tokens and log-probs, and transformers', for a batch mixing image
and text-only requests with the image spans' prefill in 16-token chunks."""

from __future__ import annotations

import pytest
import torch
from llama4_reference import IMAGE, hf_greedy
from vlm_parallel import Family, assert_vision_on_first_stage, parallel_equals, run_uni

TOWER = ("vision_model.", "multi_modal_projector.")
LLAMA4 = Family(
    IMAGE,
    hf_greedy,
    vision=TOWER,
    modules=("vision_model", "multi_modal_projector"),
    max_model_len=256,  # the tiny checkpoint's max_position_embeddings
)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_llama4 import build_tiny_llama4_conditional

    return str(build_tiny_llama4_conditional(tmp_path_factory.mktemp("tiny-llama4-vision")))


@pytest.fixture(scope="module")
def uni(path):
    return run_uni(path, LLAMA4)


def test_only_the_first_stage_reads_and_builds_the_vision_model(path):
    assert_vision_on_first_stage(path, LLAMA4)


def test_pp2_equals_pp1_and_transformers_with_images(path, uni):
    print("PP=2:", parallel_equals(uni, path, LLAMA4, pipeline_parallel_size=2))


def test_each_rank_reads_the_vision_model_whole(path):
    from safetensors.torch import load_file

    from trillm.config import EngineArgs
    from trillm.distributed.sharding import RankShapes
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.loader import iterate_weights, safetensors_files

    cfg = build_config(EngineArgs(path, tensor_parallel_size=2)).model
    whole = {k: v for f in safetensors_files(path) for k, v in load_file(f).items()}
    rank1 = dict(iterate_weights(path, shard=(cfg, RankShapes.of(cfg, 1, 2))))
    tower = [k for k in whole if k.startswith(TOWER)]
    assert tower and all(torch.equal(rank1[k], whole[k]) for k in tower)
    experts = next(k for k in whole if k.endswith("experts.down_proj"))  # [E, I, H]
    assert rank1[experts].shape[1] * 2 == whole[experts].shape[1]  # the experts are split


def test_tp2_equals_tp1_and_transformers_with_images(path, uni):
    print("TP=2:", parallel_equals(uni, path, LLAMA4, tensor_parallel_size=2))
