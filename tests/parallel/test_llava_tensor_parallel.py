"""LLaVA's images under tensor parallelism: the vision tower and projector are whole on every
rank (each rank encodes an image itself, the same rows; the language model is sharded and its
vocabulary-parallel embedding is whole after its reduce, so the image rows overwrite the same
positions everywhere). TP=2 gives TP=1's greedy tokens and log-probs, and transformers' tokens,
for a batch mixing image and text-only requests with prefill chunked across image spans."""

from __future__ import annotations

import pytest
import torch
from llava_parallel import parallel_equals_uni


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-tp")))


def test_each_rank_reads_the_vision_side_whole(llava_path):
    from safetensors.torch import load_file

    from trillm.config import EngineArgs
    from trillm.distributed.sharding import RankShapes
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.loader import iterate_weights, safetensors_files

    cfg = build_config(EngineArgs(llava_path, tensor_parallel_size=2)).model
    whole = {k: v for f in safetensors_files(llava_path) for k, v in load_file(f).items()}
    rank1 = dict(iterate_weights(llava_path, shard=(cfg, RankShapes.of(cfg, 1, 2))))
    vision = [k for k in whole if "vision_tower." in k or "multi_modal_projector." in k]
    assert any(k.endswith("self_attn.q_proj.weight") for k in vision)  # Llama-like names too
    assert all(torch.equal(rank1[k], whole[k]) for k in vision)
    text_q = next(k for k in whole if "language_model" in k and k.endswith("q_proj.weight"))
    assert rank1[text_q].shape[0] * 2 == whole[text_q].shape[0]  # the text side is sharded


def test_tp2_equals_tp1_and_transformers_with_images(llava_path):
    print("TP=2:", parallel_equals_uni(llava_path, tensor_parallel_size=2))
