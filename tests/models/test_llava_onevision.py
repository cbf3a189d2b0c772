"""LLaVA-OneVision (SigLIP tower + projector + any-resolution tiling + Qwen2) through the
Python API: the expanded prompt equals transformers' processor's for images of several sizes
and aspect ratios, greedy tokens and prompt / sample log-probabilities equal transformers' on
a batch mixing image and text-only requests with prefill chunked across the image spans, a
preempted image request resumes, and what the model cannot run is refused by name (videos:
``test_llava_onevision_video.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from llava_reference import image
from mm_engine import (
    GREEDY,
    SCORED,
    UNI,
    as_prompt,
    batch_logprob_diff,
    check_preempted_resume,
    encoder_calls,
    module_llm,
)
from onevision_reference import IMAGE, hf_greedy, hf_inputs
from qwen2_vl_reference import max_logprob_diff

from trillm import LLM
from trillm.engine.preprocess import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUDGET = 16  # max_num_batched_tokens: each image's 36-100 placeholders span several chunks
# (width, height) -> grid: 50x40 2x2 tiles; 40x90 3x2, unpadded left and right; 100x30 1x3,
# unpadded above and below; 32x32 one tile; 90x64 2x3, its 8x12 features shrunk to 6x9
# (over anyres_max_4's 4 tiles' worth)
SIZES = [(50, 40), (40, 90), (100, 30), (32, 32), (20, 200), (90, 64)]
IMAGE_ID = 4096
CASES = [
    (f"Describe {IMAGE} now", [image(0)]),
    ("The license grants", []),
    (f"{IMAGE} first, then {IMAGE} second", [image(1, (90, 64)), image(2, (100, 30))]),
    (f"Small {IMAGE}", [image(3, (32, 32))]),
]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_llava_onevision import build_tiny_llava_onevision

    return str(build_tiny_llava_onevision(tmp_path_factory.mktemp("tiny-onevision")))


@pytest.fixture(scope="module")
def llm(path):
    yield from module_llm(
        path, max_model_len=512, max_num_batched_tokens=BUDGET, limit_mm_per_prompt={"image": 2}
    )


def test_placeholder_counts_equal_the_processors(llm, path):
    counts = []
    for size in SIZES:
        img = image(7, size)
        out = llm.generate(as_prompt(f"See {IMAGE}", [img]), GREEDY)[0]
        ids = hf_inputs(path, f"See {IMAGE}", [img])["input_ids"][0].tolist()
        assert out.prompt_token_ids == ids
        counts.append(ids.count(IMAGE_ID))
    assert counts == [70, 100, 68, 36, 52, 76]


def test_mixed_batch_equals_transformers_tokens_and_logprobs(llm, path):
    before = encoder_calls(llm)
    outs = llm.generate([as_prompt(t, i) for t, i in CASES], SCORED, use_tqdm=False)
    assert encoder_calls(llm) == before + 4  # once per image, however many chunks
    assert batch_logprob_diff(path, CASES, outs, hf_greedy) < 1e-4


def test_chat_image_parts_become_the_image_token(llm, path):
    img = image(4, (64, 40))
    parts = [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "What?"}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    from llava_reference import chat_text

    ids, tokens, _ = hf_greedy(path, chat_text(path, f"{IMAGE}\nWhat?"), [img])
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)


def test_mm_processor_kwargs(llm, path):
    img = image(5, (48, 40))
    prompt = {**as_prompt(f"See {IMAGE}", [img]), "mm_processor_kwargs": {"do_normalize": False}}
    out = llm.generate(prompt, GREEDY)[0]
    ids, tokens, _ = hf_greedy(path, f"See {IMAGE}", [img], do_normalize=False)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)
    for kwargs in [{"image_grid_pinpoints": [[32, 32]]}, {"size": {"height": 16, "width": 16}}]:
        prompt = {**as_prompt(f"See {IMAGE}", [img]), "mm_processor_kwargs": kwargs}
        with pytest.raises(InvalidRequestError, match="is the model's tiling"):
            llm.generate(prompt, GREEDY)


def test_video_inputs_are_checked(llm, path):
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    # videos work (test_llava_onevision_video.py): a one-frame video of PIL frames too
    out = llm.generate({"prompt": "<video>", "multi_modal_data": {"video": [image(0)]}}, GREEDY)
    assert len(out[0].prompt_token_ids) == 4 + 1  # 2x2 pooled features and a newline
    with pytest.raises(InvalidRequestError, match=r"\['video'\]\[0\] is not a video"):
        llm.generate({"prompt": "<video>", "multi_modal_data": {"video": "x.mp4"}}, GREEDY)
    with pytest.raises(ValueError, match=r"\['audio'\]=1: LlavaOnevision.* takes no audio"):
        build_config(EngineArgs(path, limit_mm_per_prompt={"audio": 1}))
    built = build_config(EngineArgs(path, limit_mm_per_prompt={"video": 2}))
    assert built.limit_mm_per_prompt == {"image": 1, "video": 2}


def test_feature_layers_and_the_pooling_head(tmp_path):
    # Two layers' states concatenated (the projector twice as wide, the embeddings' 0 among
    # them); the tower's pooling head is in the checkpoint, unread.
    from trillm.testing.tiny_llava_onevision import build_tiny_llava_onevision

    folder = str(
        build_tiny_llava_onevision(
            tmp_path, seed=1, vision_feature_layer=[0, -2], vision_use_head=True
        )
    )
    text, images = CASES[2]
    other = LLM(folder, max_model_len=512, limit_mm_per_prompt={"image": 2}, **UNI)
    try:
        out = other.generate(as_prompt(text, images), SCORED)[0]
    finally:
        other.shutdown()
    ids, tokens, logprobs = hf_greedy(folder, text, images)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)
    assert max_logprob_diff(out, ids, logprobs) < 1e-4


def test_preempted_image_requests_resume(path):
    cases = [CASES[0], CASES[2], CASES[1], CASES[3]]
    check_preempted_resume(
        path,
        cases,
        [as_prompt(*case) for case in cases],
        hf_greedy,
        max_model_len=256,
        num_gpu_blocks_override=16,  # 4 requests need 24 blocks: forces preemption
        max_num_batched_tokens=64,
        limit_mm_per_prompt={"image": 2},
    )


def _folder(path: str, tmp_path, change: dict, where: str | None = None) -> str:
    folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
    shutil.copytree(path, folder)
    data = json.loads((folder / "config.json").read_text())
    (data[where] if where else data).update(change)
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder)


def test_config_fields_trillm_cannot_run_are_refused(path, tmp_path):
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    assert build_config(EngineArgs(path)).limit_mm_per_prompt == {"image": 1, "video": 1}
    for change, where, words in [
        ({"vision_feature_select_strategy": "default"}, None, "strategy 'default' is not"),
        ({"vision_aspect_ratio": "pad"}, None, "vision_aspect_ratio 'pad' is not supported"),
        ({"image_grid_pinpoints": [[32, 40]]}, None, "whole tiles of the tower's image_size"),
        ({"use_sliding_window": True}, "text_config", "use_sliding_window is not supported"),
        ({"model_type": "llama"}, "text_config", "a 'llama' language model is not supported"),
        ({"model_type": "clip_vision_model"}, "vision_config", "'clip_vision_model' vision"),
        ({"projector_hidden_act": "bogus"}, None, "projector_hidden_act 'bogus'"),
        ({"hidden_act": "bogus"}, "vision_config", "vision hidden_act 'bogus'"),
        ({"num_channels": 4}, "vision_config", "num_channels 4 is not supported"),
        ({"is_encoder_decoder": True}, None, "is_encoder_decoder=true is not a"),
    ]:
        with pytest.raises(ValueError, match=words):
            LLM(_folder(path, tmp_path, change, where), **UNI)
    with pytest.raises(ValueError, match="image_grid_pinpoints differ from config.json's"):
        LLM(_folder(path, tmp_path, {"image_grid_pinpoints": [[32, 32]]}), **UNI)
    with pytest.raises(ValueError, match="is the model's tiling"):
        LLM(path, mm_processor_kwargs={"do_pad": False}, **UNI)
    folder = _folder(path, tmp_path, {})
    fields = json.loads((tmp_path / folder / "processor_config.json").read_text())
    fields["vision_aspect_ratio"] = "anyres_max_9"
    (tmp_path / folder / "processor_config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="vision_aspect_ratio 'anyres_max_9' is not the model's"):
        LLM(folder, **UNI)


def test_fields_name_every_onevision_and_siglip_config_field():
    import dataclasses

    from transformers import LlavaOnevisionConfig, SiglipVisionConfig

    from trillm.model_executor import onevision_config

    fields = {f.name for f in dataclasses.fields(LlavaOnevisionConfig)}
    assert fields - set(onevision_config.FIELDS) == set()
    vision = {f.name for f in dataclasses.fields(SiglipVisionConfig)}
    assert vision - set(onevision_config.VISION_FIELDS) == set()


def test_transformers_defaults_fill_what_config_json_leaves_out(path):
    from trillm.model_executor.multimodal_config import split_config

    data = json.loads((Path(path) / "config.json").read_text())
    for key in ("image_token_index", "video_token_index", "vision_aspect_ratio"):
        del data[key]
    _, mm = split_config(data, "LlavaOnevisionForConditionalGeneration")
    assert (mm["image_token_index"], mm["video_token_index"]) == (151_646, 151_647)
    assert mm["vision_aspect_ratio"] == "anyres_max_9"


def test_transformers_new_checkpoint_layout_loads_the_same_model(llm, path, tmp_path):
    # model.language_model.* / model.vision_tower.vision_model.* / model.image_newline / lm_head
    from safetensors.torch import load_file, save_file

    folder = Path(_folder(path, tmp_path, {}))
    tensors = load_file(folder / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        elif name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("vision_tower."):
            name = "model.vision_tower.vision_model." + name.removeprefix("vision_tower.")
        else:
            name = "model." + name
        renamed[name] = tensor
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    text, images = CASES[2]
    other = LLM(str(folder), max_model_len=512, limit_mm_per_prompt={"image": 2}, **UNI)
    try:
        got = other.generate(as_prompt(text, images), GREEDY)[0].outputs[0].token_ids
    finally:
        other.shutdown()
    assert got == llm.generate(as_prompt(text, images), GREEDY)[0].outputs[0].token_ids
