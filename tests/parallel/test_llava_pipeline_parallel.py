"""LLaVA's images under pipeline parallelism: the vision tower and projector live on the first
stage only (its loader reads their tensors, the second stage reads none and builds none), which
encodes each image and writes its rows over the token embeddings; the later stage receives
hidden states as for text. PP=2 gives PP=1's greedy tokens and log-probs, and transformers'
tokens, for a batch mixing image and text-only requests with prefill chunked across image
spans, under the encoder budget of one image per step."""

from __future__ import annotations

import pytest
from llava_parallel import LLAVA, parallel_equals_uni
from vlm_parallel import assert_vision_on_first_stage


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-pp")))


def test_only_the_first_stage_reads_and_builds_the_vision_side(llava_path):
    assert_vision_on_first_stage(llava_path, LLAVA)


def test_pp2_equals_pp1_and_transformers_with_images(llava_path):
    print("PP=2:", parallel_equals_uni(llava_path, pipeline_parallel_size=2))
