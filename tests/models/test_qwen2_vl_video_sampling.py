"""Frame sampling asked by ``mm_processor_kwargs`` (``do_sample_frames`` with ``num_frames``
or ``fps``, the keys vLLM passes to transformers' video processor) and ``video_url`` parts in
``LLM.chat``, on the tiny Qwen2.5-VL: the frames chosen are those
``Qwen2VLVideoProcessor.sample_frames`` chooses (and their sampled fps its ``sampled_fps``),
greedy tokens and log-probabilities equal transformers' on the sampled frames, a chat's
``video_url`` (an MP4 made with PyAV, the ``trillm[video]`` extra) is greedy-exact as over
HTTP, and the keys that would be ignored or cannot apply are refused by name."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from qwen2_vl_reference import max_logprob_diff
from qwen2_vl_video_reference import VIDEO, _video_processor_class, hf_mixed_greedy

from trillm import LLM, SamplingParams
from trillm.engine.media import MultiModalInputError
from trillm.engine.preprocess import InvalidRequestError
from trillm.engine.video_sampling import FrameSampling, sample_indices, sampled

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCORED = SamplingParams(
    temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1
)
RATE = 8  # the MP4's frames a second
CHAT_TEXT = f"<|im_start|>user\n{VIDEO}\nWhat happens?<|im_end|>\n<|im_start|>assistant\n"


def frames(seed: int, count: int, side: int = 16) -> np.ndarray:  # [T, H, W, 3] uint8
    return np.random.default_rng(seed).integers(0, 256, (count, side, side, 3), dtype=np.uint8)


def hf_indices(total: int, rate: float | None, **kwargs) -> list[int]:
    """transformers' own choice (``Qwen2VLVideoProcessor.sample_frames``) of ``total`` frames
    running at ``rate`` (None: unknown)."""
    from transformers.video_utils import VideoMetadata

    processor = _video_processor_class()()
    metadata = VideoMetadata(total_num_frames=total, fps=rate)
    return processor.sample_frames(metadata, temporal_patch_size=2, **kwargs).tolist()


@pytest.mark.parametrize(
    ("total", "rate", "asked"),
    [
        (8, None, {"num_frames": 4}),
        (9, None, {"num_frames": 3}),  # rounded to 2 (whole temporal patches)
        (97, 24.0, {"num_frames": 16}),
        (30, None, {"num_frames": 7}),
        (8, 8.0, {"fps": 4}),
        (97, 24.0, {"fps": 1.5}),  # below min_frames: 4
        (300, 29.97, {"fps": 0.5}),
        (900, 30.0, {"fps": 30}),  # capped at max_frames (768)
        (11, 5.0, {"fps": 100}),  # capped at the frames there are, whole patches: 10
        (8, None, {"num_frames": 12}),  # more than there are: refused by both
        (8, None, {"fps": 2}),  # no rate to sample by: refused by both
        (1, 1.0, {"num_frames": 1}),  # rounds to 0 frames: both refuse
    ],
)
def test_sampled_frames_are_transformers_choice(total, rate, asked):
    from transformers.video_utils import VideoMetadata

    sampling = FrameSampling(asked.get("num_frames"), asked.get("fps"))
    try:
        ref = hf_indices(total, rate, **asked)
    except (ValueError, ZeroDivisionError):
        with pytest.raises(MultiModalInputError):
            sample_indices(sampling, total, rate, 2, "mm_processor_kwargs")
        return
    assert sample_indices(sampling, total, rate, 2, "mm_processor_kwargs").tolist() == ref
    clip = np.arange(total)  # stands for [T, H, W, 3] frames: only the first axis is indexed
    chosen, fps = sampled(sampling, clip, rate, 2, "p")
    assert chosen.tolist() == ref
    metadata = VideoMetadata(total_num_frames=total, fps=rate, frames_indices=ref)
    assert fps == (None if rate is None else pytest.approx(metadata.sampled_fps, rel=1e-12))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_qwen2_vl import build_tiny_qwen2_vl

    return str(build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), version="2.5"))


@pytest.fixture(scope="module")
def llm(path):
    engine = LLM(
        path,
        max_model_len=256,
        kv_cache_memory="8MiB",
        max_num_batched_tokens=32,
        limit_mm_per_prompt={"image": 1, "video": 1},
        distributed_executor_backend="uni",
    )
    yield engine
    engine.shutdown()


def test_num_frames_sampling_equals_transformers_on_its_frames(path, llm):
    clip = frames(0, 12)  # 12 frames, 4 asked: transformers takes 0, 3, 6, 9
    kwargs = {"do_sample_frames": True, "num_frames": 4}
    prompt = {"prompt": f"Watch {VIDEO}", "multi_modal_data": {"video": clip}}
    out = llm.generate({**prompt, "mm_processor_kwargs": kwargs}, SCORED, use_tqdm=False)[0]
    chosen = clip[hf_indices(12, None, num_frames=4)]
    ids, tokens, logprobs = hf_mixed_greedy(path, f"Watch {VIDEO}", [], [chosen], 6)
    assert out.prompt_token_ids == ids  # 2 temporal patches of 2x2 merged tokens
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_diff(out, ids, logprobs) < 1e-4


def mp4(clip: np.ndarray) -> str:
    """An MPEG-4 data URL of ``clip`` at ``RATE`` frames a second (PyAV's encoder)."""
    av = pytest.importorskip("av", reason="video files need PyAV (the trillm[video] extra)")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=RATE)
        stream.height, stream.width = clip.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in clip:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return f"data:video/mp4;base64,{base64.b64encode(buf.getvalue()).decode()}"


def decoded(url: str) -> np.ndarray:  # [T, H, W, 3]: the frames the engine decodes
    import av

    raw = base64.b64decode(url.split(",", 1)[1])
    with av.open(io.BytesIO(raw)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.mark.parametrize(
    ("kwargs", "picked", "fps"),
    [
        (None, list(range(8)), RATE),  # every frame, 1 time unit a temporal patch
        ({"do_sample_frames": True, "fps": 4}, [0, 2, 4, 6], 4),  # 4 of 8 frames: half the rate
    ],
)
def test_chat_video_url_is_greedy_exact(path, llm, kwargs, picked, fps):
    url = mp4(frames(7, 8))
    parts = [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What happens?"},
    ]
    options = {} if kwargs is None else {"mm_processor_kwargs": kwargs}
    messages = [{"role": "user", "content": parts}]
    out = llm.chat(messages, SCORED, use_tqdm=False, **options)[0]
    assert kwargs is None or hf_indices(8, RATE, **kwargs) == picked
    chosen = decoded(url)[picked]
    ids, tokens, logprobs = hf_mixed_greedy(path, CHAT_TEXT, [], [chosen], 6, fps)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_diff(out, ids, logprobs) < 1e-4


def test_frame_keys_that_cannot_apply_are_refused_by_name(llm):
    prompt = {"prompt": f"Watch {VIDEO}", "multi_modal_data": {"video": frames(1, 8)}}
    cases = [
        ({"num_frames": 4}, "num_frames and fps sample a video's frames only with "),
        ({"fps": 2.0, "do_sample_frames": False}, "only with do_sample_frames=True"),
        ({"do_sample_frames": True, "num_frames": 4, "fps": 2}, "num_frames and fps exclude"),
        ({"do_sample_frames": True, "fps": 2}, "sampling by fps needs the video's frame rate"),
        ({"do_sample_frames": True, "num_frames": 10}, "the video has 8 frames; sampling asks"),
        ({"do_sample_frames": "yes"}, "do_sample_frames is a boolean"),
        ({"do_sample_frames": True}, "do_sample_frames=True needs num_frames or fps"),
        ({"do_sample_frames": True, "num_frames": 0}, "num_frames is a whole number >= 1"),
        ({"do_sample_frames": True, "fps": -1}, "fps is a number > 0"),
        ({"min_frames": 2}, "'min_frames' not taken by this model's image processor"),
    ]
    for kwargs, words in cases:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate({**prompt, "mm_processor_kwargs": kwargs}, SCORED, use_tqdm=False)
        assert words in str(info.value), str(info.value)
    with pytest.raises(MultiModalInputError, match="A video_url part needs its video_url.url"):
        parts = [{"type": "video_url", "video_url": {}}]
        llm.chat([{"role": "user", "content": parts}], SCORED, use_tqdm=False)
