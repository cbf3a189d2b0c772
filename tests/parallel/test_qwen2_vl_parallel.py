"""Qwen2-VL and Qwen2.5-VL with images under pipeline and tensor parallelism. PP=2: the vision
tower (``visual``) is read, built and run on the first stage only, which writes the image rows
over its token embeddings; every stage computes the requests' M-RoPE positions [3, T] from
their items itself (each rank holds the items), so the second stage rotates as the first.
TP=2: the tower is whole on every rank (Qwen2.5-VL's has gate/up/down_proj names that the
text split would otherwise cut). Both give the one-rank engine's greedy tokens and log-probs,
and transformers', for a batch mixing image, video and text-only requests with the image
spans' prefill in 16-token chunks (the video's tokens: equal to one rank's; transformers'
video reference is tests/models/test_qwen2_vl_video.py's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qwen2_vl_reference import IMAGE, hf_greedy
from qwen2_vl_video_reference import VIDEO
from vlm_parallel import Family, assert_vision_on_first_stage, parallel_equals, run_uni

# 8 frames of 16x16: 4 temporal patches of 2x2 merged tokens, the video's time (0..3) running
# past the text after it, as on one rank
FRAMES = np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3), dtype=np.uint8)
WATCH = {"prompt": f"Watch {VIDEO} now", "multi_modal_data": {"video": [FRAMES]}}
QWEN2_VL = Family(IMAGE, hf_greedy, vision=("visual.",), modules=("visual",), videos=(WATCH,))


@pytest.fixture(scope="module", params=["2", "2.5"])
def path(request, tmp_path_factory):
    from trillm.testing.tiny_qwen2_vl import build_tiny_qwen2_vl

    root = tmp_path_factory.mktemp(f"tiny-qwen2-vl-{request.param}")
    return str(build_tiny_qwen2_vl(root, version=request.param))


@pytest.fixture(scope="module")
def uni(path):
    return run_uni(path, QWEN2_VL)


def test_only_the_first_stage_reads_and_builds_the_tower(path):
    assert_vision_on_first_stage(path, QWEN2_VL)


def test_pp2_equals_pp1_and_transformers_with_images(path, uni):
    print("PP=2:", parallel_equals(uni, path, QWEN2_VL, pipeline_parallel_size=2))


def test_each_rank_reads_the_tower_whole(path):
    from safetensors.torch import load_file

    from trillm.config import EngineArgs
    from trillm.distributed.sharding import RankShapes
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.loader import iterate_weights, safetensors_files

    cfg = build_config(EngineArgs(path, tensor_parallel_size=2)).model
    whole = {k: v for f in safetensors_files(path) for k, v in load_file(f).items()}
    rank1 = dict(iterate_weights(path, shard=(cfg, RankShapes.of(cfg, 1, 2))))
    vision = [k for k in whole if k.startswith("visual.")]
    assert vision and all(torch.equal(rank1[k], whole[k]) for k in vision)
    text_q = next(k for k in whole if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert rank1[text_q].shape[0] * 2 == whole[text_q].shape[0]  # the text side is sharded


def test_tp2_equals_tp1_and_transformers_with_images(path, uni):
    print("TP=2:", parallel_equals(uni, path, QWEN2_VL, tensor_parallel_size=2))
