"""LLaVA-OneVision with images under pipeline and tensor parallelism. PP=2: the SigLIP tower,
the projector and ``image_newline`` (a parameter, not a module) are read, built and run on the
first stage only, which tiles, packs and writes the image rows over its token embeddings; the
later stage gets hidden states. TP=2: they are whole on every rank. Both give the one-rank
engine's greedy tokens and log-probs, and transformers', for a batch mixing image, video and
text-only requests with the image spans' prefill in 16-token chunks (the video's tokens: equal
to one rank's; its transformers reference is tests/models/test_llava_onevision_video.py's)."""

from __future__ import annotations

import numpy as np
import pytest
from onevision_reference import IMAGE, hf_greedy
from vlm_parallel import Family, assert_vision_on_first_stage, parallel_equals, run_uni

# 4 frames at the tower's tile size: 4 x 2x2 pooled features and one image_newline
FRAMES = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
WATCH = {"prompt": "Watch <video> now", "multi_modal_data": {"video": [FRAMES]}}
ONEVISION = Family(
    IMAGE,
    hf_greedy,
    vision=("vision_tower.", "multi_modal_projector.", "image_newline"),
    modules=("vision_tower", "multi_modal_projector", "image_newline"),
    videos=(WATCH,),
)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_llava_onevision import build_tiny_llava_onevision

    return str(build_tiny_llava_onevision(tmp_path_factory.mktemp("tiny-onevision-parallel")))


@pytest.fixture(scope="module")
def uni(path):
    return run_uni(path, ONEVISION)


def test_only_the_first_stage_reads_and_builds_the_vision_side(path):
    assert_vision_on_first_stage(path, ONEVISION)


def test_pp2_equals_pp1_and_transformers_with_images(path, uni):
    print("PP=2:", parallel_equals(uni, path, ONEVISION, pipeline_parallel_size=2))


def test_tp2_equals_tp1_and_transformers_with_images(path, uni):
    print("TP=2:", parallel_equals(uni, path, ONEVISION, tensor_parallel_size=2))
