"""Gemma 3 with images under pipeline and tensor parallelism. PP=2: the SigLIP tower and the
projector are read, built and run on the first stage only, which writes the image rows over
its (scaled) token embeddings; every stage builds the bidirectional attention among an image's
tokens from the requests' items itself (each rank holds the items), so the second stage's
layers attend as the first's. TP=2: the tower and projector are whole on every rank. Both give
the one-rank engine's greedy tokens and log-probs, and transformers', for a batch mixing image
and text-only requests whose prefill is chunked around the image spans (20-token steps: a
span's 16 tokens stay in one chunk, the text around them does not)."""

from __future__ import annotations

import pytest
from gemma3_reference import IMAGE, hf_greedy
from vlm_parallel import Family, assert_vision_on_first_stage, parallel_equals, run_uni

MODULES = ("vision_tower", "multi_modal_projector")
GEMMA3 = Family(
    IMAGE, hf_greedy, vision=("vision_tower.", "multi_modal_projector."), modules=MODULES, budget=20
)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_gemma3 import build_tiny_gemma3

    return str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-parallel")))


@pytest.fixture(scope="module")
def uni(path):
    return run_uni(path, GEMMA3)


def test_only_the_first_stage_reads_and_builds_the_vision_side(path):
    assert_vision_on_first_stage(path, GEMMA3)


def test_pp2_equals_pp1_and_transformers_with_images(path, uni):
    print("PP=2:", parallel_equals(uni, path, GEMMA3, pipeline_parallel_size=2))


def test_tp2_equals_tp1_and_transformers_with_images(path, uni):
    print("TP=2:", parallel_equals(uni, path, GEMMA3, tensor_parallel_size=2))
