"""LLaVA-OneVision videos through the Python API (``multi_modal_data["video"]``, ``LLM.chat``
``video_url`` parts): the frames' pixel values equal the folder's own
``LlavaOnevisionVideoProcessor``'s (its mean and deviation, not the image processor's), each
``<video>`` becomes ``replace_video_token``'s count, greedy tokens and prompt / sample
log-probabilities equal transformers' on a batch mixing video, image + video, image and
text-only requests (prefill chunked across the spans), and what cannot apply is refused by
name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from llava_reference import image
from onevision_reference import IMAGE, VIDEO, hf_video_greedy, hf_video_values
from qwen2_vl_reference import max_logprob_diff
from video_files import decoded, mp4, video_data_url

from trillm import LLM, SamplingParams
from trillm.engine.preprocess import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCORED = SamplingParams(
    temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
VIDEO_ID = 4097
UNI = {"kv_cache_memory": "8MiB", "distributed_executor_backend": "uni"}


def frames(seed: int, count: int = 4, side: int = 32) -> np.ndarray:  # [T, H, W, 3] uint8
    """Frames at the tiny tower's tile size (32 pixels: what the reference runs unresized)."""
    return np.random.default_rng(seed).integers(0, 256, (count, side, side, 3), dtype=np.uint8)


# 4 frames: 4 x (4x4 patches pooled to 2x2) + 1 newline = 17 placeholders; 3 frames: 13
CASES = [  # (prompt, images, video)
    (f"Watch {VIDEO} now", [], frames(0)),
    (f"{IMAGE} and then {VIDEO} both", [image(1, (50, 40))], frames(1, 3)),
    (f"Describe {IMAGE}", [image(2, (40, 90))], None),
    ("The license grants", [], None),
]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_llava_onevision import build_tiny_llava_onevision

    return str(build_tiny_llava_onevision(tmp_path_factory.mktemp("tiny-onevision-video")))


@pytest.fixture(scope="module")
def llm(path):
    engine = LLM(
        path,
        max_model_len=512,
        max_num_batched_tokens=16,  # each video's 13-17 placeholders span chunks
        limit_mm_per_prompt={"image": 1, "video": 1},
        **UNI,
    )
    yield engine
    engine.shutdown()


def as_prompt(text: str, images: list, video: np.ndarray | None, **extra) -> object:
    data = {"image": images} if images else {}
    if video is not None:
        data["video"] = video
    return {"prompt": text, "multi_modal_data": data, **extra} if data else text


def encoder_calls(engine: LLM) -> int:
    return engine.engine.cores[0].executor.runner.mm.encoder_calls


def test_frame_values_equal_the_folders_video_processor(path):
    from trillm.engine.onevision_video import frame_values, load_processing
    from trillm.model_executor.multimodal_config import split_config

    data = json.loads((Path(path) / "config.json").read_text())
    mm = split_config(data, "LlavaOnevisionForConditionalGeneration")[1]
    processing = load_processing(path, mm)
    assert processing.image_mean == (0.5, 0.5, 0.5)  # the video processor's, not the image's
    clip = frames(3, 5)
    ours = frame_values(processing, clip)
    ref = hf_video_values(path, clip)[0].numpy()
    assert ours.shape == ref.shape == (5, 3, 32, 32)
    np.testing.assert_allclose(ours, ref, atol=1e-6)
    # frames of another size are resized to the tile (PIL's bicubic)
    assert frame_values(processing, frames(4, 2, 48)).shape == (2, 3, 32, 32)


def test_mixed_batch_equals_transformers_tokens_and_logprobs(llm, path):
    before = encoder_calls(llm)
    outs = llm.generate([as_prompt(*case) for case in CASES], SCORED, use_tqdm=False)
    assert encoder_calls(llm) == before + 4  # two videos, two images: once each, in chunks
    worst = 0.0
    for (text, images, video), out in zip(CASES, outs, strict=True):
        ids, tokens, logprobs = hf_video_greedy(path, text, images, video)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens
        worst = max(worst, max_logprob_diff(out, ids, logprobs))
    assert outs[0].prompt_token_ids.count(VIDEO_ID) == 17
    assert outs[1].prompt_token_ids.count(VIDEO_ID) == 13
    assert worst < 1e-4


def test_mm_processor_kwargs_apply_to_the_video(llm, path):
    text, _, video = CASES[0]
    kwargs = {"do_normalize": False}
    out = llm.generate(as_prompt(text, [], video, mm_processor_kwargs=kwargs), GREEDY)[0]
    ids, tokens, _ = hf_video_greedy(path, text, [], video, n=6, **kwargs)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)
    plain = llm.generate(as_prompt(text, [], video), GREEDY)[0].outputs[0].token_ids
    assert plain != tokens, "unnormalized frames should change the tiny model's answer"
    asked = as_prompt(text, [], video, mm_processor_kwargs={"resample": 2})
    with pytest.raises(InvalidRequestError, match="'resample' not applied to videos"):
        llm.generate(asked, GREEDY)


def test_chat_video_url_part(llm, path):
    data = mp4(frames(5, 3))
    parts = [{"type": "video_url", "video_url": {"url": video_data_url(data)}}]
    parts.append({"type": "text", "text": "What?"})
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    from llava_reference import chat_text

    text = chat_text(path, f"{VIDEO}\nWhat?")
    ids, tokens, _ = hf_video_greedy(path, text, [], decoded(data), n=6)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)


def test_video_refusals(llm):
    two = {"prompt": f"{VIDEO} {VIDEO}", "multi_modal_data": {"video": [frames(0), frames(1)]}}
    with pytest.raises(InvalidRequestError, match=r"2 videos, at most 1 per prompt"):
        llm.generate(two, GREEDY)
    with pytest.raises(InvalidRequestError, match="1 video placeholder.* has 0 video"):
        llm.generate({"prompt": f"x {VIDEO}", "multi_modal_data": {"image": []}}, GREEDY)
    bad = {"prompt": VIDEO, "multi_modal_data": {"video": frames(0).astype(np.float32)}}
    with pytest.raises(InvalidRequestError, match=r"must be a uint8 numpy array"):
        llm.generate(bad, GREEDY)


def test_video_processor_configs_the_model_cannot_take_are_refused(path, tmp_path):
    for change, words in [
        ({"size": {"height": 16, "width": 16}}, "size .* is not the vision tower's 32x32"),
        ({"do_center_crop": True}, "do_center_crop=true is not implemented"),
        ({"do_sample_frames": True}, "do_sample_frames=true is not implemented"),
    ]:
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, folder)
        config = folder / "video_preprocessor_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
        with pytest.raises(ValueError, match=words):
            LLM(str(folder), limit_mm_per_prompt={"video": 1}, **UNI)
    # videos off: the image side serves whatever the video processor says
    LLM(str(folder), limit_mm_per_prompt={"video": 0}, **UNI).shutdown()
