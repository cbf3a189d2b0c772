"""LLaVA's images under pipeline parallelism: the vision tower and projector live on the first
stage only (its loader reads their tensors, the second stage reads none and builds none), which
encodes each image and writes its rows over the token embeddings; the later stage receives
hidden states as for text. PP=2 gives PP=1's greedy tokens and log-probs, and transformers'
tokens, for a batch mixing image and text-only requests with prefill chunked across image
spans, under the encoder budget of one image per step."""

from __future__ import annotations

import pytest
from llava_parallel import parallel_equals_uni


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-pp")))


def test_only_the_first_stage_reads_and_builds_the_vision_side(llava_path):
    from trillm.attention.selector import get_attention_backend
    from trillm.config import EngineArgs
    from trillm.distributed.pipeline import PipelineGroup, PPMissingLayer, set_pp_group
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.loader import build_model, safetensors_files, stage_filter

    cfg = build_config(EngineArgs(llava_path, pipeline_parallel_size=2)).model
    names = [k for f in safetensors_files(llava_path) for k in _keys(f)]
    vision = [k for k in names if "vision_tower." in k or "multi_modal_projector." in k]
    assert any(".layers.1." in k for k in vision)  # the tower's layer names look like decoder's
    for stage in (0, 1):
        set_pp_group(PipelineGroup(stage, 2, start_layer=stage, end_layer=stage + 1))
        try:
            wanted = stage_filter(cfg)
            assert wanted is not None
            assert [wanted(k) for k in vision] == [stage == 0] * len(vision)
            model = build_model(cfg, get_attention_backend("torch", "cpu"), "cpu")
        finally:
            set_pp_group(PipelineGroup())
        assert isinstance(model.vision_tower, PPMissingLayer) == (stage == 1)
        assert isinstance(model.multi_modal_projector, PPMissingLayer) == (stage == 1)


def _keys(file: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        return list(f.keys())


def test_pp2_equals_pp1_and_transformers_with_images(llava_path):
    diff = parallel_equals_uni(llava_path, pipeline_parallel_size=2)
    print(f"max |logprob diff| PP=2 vs PP=1: {diff:.2e}")
