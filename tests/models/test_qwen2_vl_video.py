"""Qwen2-VL and Qwen2.5-VL videos through the Python API (``multi_modal_data["video"]``): the
frames' patches equal transformers' ``Qwen2VLVideoProcessor``'s, greedy tokens and prompt /
sample log-probabilities equal transformers' on a batch mixing video, image + video and
text-only requests (prefill chunked across the spans), M-RoPE positions (temporal ones, and
generated tokens after a video whose time runs past its text) equal ``get_rope_index``'s, and
videos past the limits are refused by name before any frame is processed."""

from __future__ import annotations

import numpy as np
import pytest
from llava_reference import image
from qwen2_vl_reference import IMAGE, hf_parts, max_logprob_diff
from qwen2_vl_video_reference import VIDEO, hf_mixed_greedy, hf_mixed_inputs, hf_video_values

from trillm import LLM, SamplingParams
from trillm.engine.preprocess import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCORED = SamplingParams(
    temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1
)
VIDEO_PAD_ID = 4099


def frames(seed: int, count: int = 8, side: int = 16) -> np.ndarray:  # [T, H, W, 3] uint8
    """Frames already on the tiny model's patch grid (sides multiples of 8)."""
    return np.random.default_rng(seed).integers(0, 256, (count, side, side, 3), dtype=np.uint8)


# 8 frames of 16x16: 4 temporal patches of 2x2 merged tokens, so Qwen2-VL's time (0..3) runs
# past the text after the video (2 positions on); 4 frames of 32x32: 2 x 4x4 tokens
CASES = [  # (prompt, images, videos)
    (f"Watch {VIDEO}", [], [frames(0)]),
    (f"{IMAGE} and then {VIDEO} both", [image(1)], [frames(1, 4, 32)]),
    ("The license grants", [], []),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from trillm.testing.tiny_qwen2_vl import build_tiny_qwen2_vl

    root = tmp_path_factory.mktemp("tiny-qwen2-vl-video")
    return {v: str(build_tiny_qwen2_vl(root / v, version=v)) for v in ("2", "2.5")}


@pytest.fixture(scope="module", params=["2", "2.5"])
def model(request, paths):
    engine = LLM(
        paths[request.param],
        max_model_len=256,
        kv_cache_memory="8MiB",
        max_num_batched_tokens=16,  # each video's 16-32 placeholders span chunks
        limit_mm_per_prompt={"image": 1, "video": 1},
        distributed_executor_backend="uni",
    )
    yield paths[request.param], engine
    engine.shutdown()


def as_prompt(text: str, images: list, videos: list) -> object:
    data = {k: v for k, v in (("image", images), ("video", videos)) if len(v)}
    return {"prompt": text, "multi_modal_data": data} if data else text


def test_frame_patches_equal_transformers_video_processor(paths):
    from PIL import Image

    from trillm.engine.video_inputs import rgb_frames, video_patches

    processor = hf_parts(paths["2"])[2]
    pil = [Image.fromarray(f) for f in frames(3, 3, 24)]
    for clip in [frames(2), frames(4, 5, 32), pil]:  # 5 and 3 frames: the last one repeated
        ours = video_patches(processor, rgb_frames(clip), {})
        ref = hf_video_values(paths["2"], rgb_frames(clip))
        assert list(ours.shape[:3]) == ref["video_grid_thw"][0].tolist()
        flat = ours.reshape(-1, ours.shape[-1])
        np.testing.assert_allclose(flat, ref["pixel_values_videos"].numpy(), atol=1e-5)


def test_mixed_batch_equals_transformers_tokens_and_logprobs(model):
    path, llm = model
    outs = llm.generate([as_prompt(*case) for case in CASES], SCORED, use_tqdm=False)
    for (text, images, videos), out in zip(CASES, outs, strict=True):
        ids, tokens, logprobs = hf_mixed_greedy(path, text, images, videos)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens
        assert max_logprob_diff(out, ids, logprobs) < 1e-4
    assert outs[0].prompt_token_ids.count(VIDEO_PAD_ID) == 4 * 2 * 2
    assert outs[1].prompt_token_ids.count(VIDEO_PAD_ID) == 2 * 4 * 4


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_video_mrope_positions_equal_get_rope_index(paths, version):
    # temporal positions (Qwen2.5-VL: k * tokens_per_second * 2 / 24 frames a second,
    # floored), for chunks starting anywhere and for generated tokens (the sequence's own
    # positions, as generate's and the whole-sequence forward's)
    import torch

    from trillm.engine.video_inputs import time_interval
    from trillm.messages import MultiModalItem
    from trillm.worker.mrope_positions import mrope_positions

    path = paths[version]
    model, _, _ = hf_parts(path)
    long_video = frames(5, 40)  # 20 temporal patches: Qwen2.5-VL's time reaches 6
    text = f"{IMAGE} see {VIDEO} then {VIDEO}"
    enc = hf_mixed_inputs(path, text, [image(2)], [frames(6), long_video])
    kwargs = {k: enc.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    if version == "2.5":
        kwargs["second_per_grid_ts"] = enc["second_per_grid_ts"]
    ids = enc["input_ids"][0].tolist()
    n = len(ids) + 4  # and 4 generated tokens
    types = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, 4, dtype=torch.int32)], 1)
    whole = torch.cat([enc["input_ids"], torch.tensor([[7, 8, 9, 10]])], 1)
    ref = model.model.get_rope_index(whole, types, **kwargs)[0][:, 0]
    interval = time_interval(model.config.to_dict(), 2, 24.0)
    grids = [("image", g) for g in enc["image_grid_thw"].tolist()]
    grids += [("video", g) for g in enc["video_grid_thw"].tolist()]
    items, start = [], 0
    for kind, grid in grids:
        offset = ids.index(4098 if kind == "image" else VIDEO_PAD_ID, start)
        length = grid[0] * grid[1] * grid[2] // 4
        step = interval if kind == "video" else 1.0
        items.append(MultiModalItem(kind, "h", offset, length, b"", [*grid, 96], step))
        start = offset + length
    for lo, hi in [(0, n), (5, 40), (n - 6, n), (n - 1, n)]:
        got = mrope_positions(items, np.arange(lo, hi), 2)
        assert got.tolist() == ref[:, lo:hi].tolist()
    assert int(ref[0].max()) > int(ref[0, -5])  # the last video's time ran past its text


def test_videos_past_the_limits_are_refused_by_name(model):
    _, llm = model
    big = np.zeros((1, 1, 1, 3), np.uint8)  # broadcast: sizes without the memory
    cases = [
        ([frames(0)] * 2, "2 videos, at most 1 per prompt (limit_mm_per_prompt)"),
        (np.broadcast_to(big, (769, 2, 2, 3)), "769 frames; a video has 1 to 768 frames"),
        (np.broadcast_to(big, (1, 4097, 4096, 3)), "more than the limit of 16777216 pixels"),
        (np.broadcast_to(big, (600, 512, 512, 3)), "more than the limit of 134217728 pixels"),
        (frames(0).astype(np.float32), "must be a uint8 numpy array"),
        ("a.mp4", "is not a video"),
    ]
    for value, words in cases:  # multi_modal_data["video"]: a video or a list of them
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(as_prompt(f"See {VIDEO}", [], value), SCORED, use_tqdm=False)
        assert words in str(info.value)
    with pytest.raises(InvalidRequestError, match=r"2 video placeholder\(s\) but .* has 1 video"):
        llm.generate(as_prompt(f"{VIDEO}{VIDEO}", [], [frames(0)]), SCORED, use_tqdm=False)
