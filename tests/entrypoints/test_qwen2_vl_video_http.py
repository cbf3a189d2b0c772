"""A chat ``video_url`` part over HTTP with the official openai client on the tiny Qwen2.5-VL: an
MP4 in a data: URL (made and decoded here with PyAV, the ``trillm[video]`` extra) is
greedy-exact vs transformers on the frames PyAV decodes (its part written as
``<|vision_start|><|video_pad|><|vision_end|>``, its temporal patches spaced by the file's
frame rate), and bad videos (a frame over the pixel limit in a small file, bytes that are no
video, an image media type, more videos than the limit, no URL) are a 400 in OpenAI's error
shape naming the problem; without PyAV a video file is refused naming the extra."""

from __future__ import annotations

from functools import partial

import numpy as np
import openai
import pytest
from mm_http import MAX_NEW, greedy_chat, openai_server
from qwen2_vl_video_reference import VIDEO, hf_mixed_greedy
from video_files import decoded, mp4
from video_files import video_data_url as data_url

NAME = "tiny-qwen2.5-vl-video"
RATE = 8  # frames a second: 8 frames of 16x16 -> 4 temporal patches 1 time unit apart


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_qwen2_vl import build_tiny_qwen2_vl

    folder = tmp_path_factory.mktemp("tiny-qwen2.5-vl-video")
    return str(build_tiny_qwen2_vl(folder, version="2.5"))


@pytest.fixture(scope="module")
def client(path, tmp_path_factory):
    pytest.importorskip("av", reason="video files need PyAV (the trillm[video] extra)")
    log = tmp_path_factory.mktemp("server-qwen2-vl-video") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "256"]
    args += ["--kv-cache-memory", "8MiB", "--max-num-seqs", "4"]
    args += ["--distributed-executor-backend", "uni", "--max-num-batched-tokens", "16"]
    args += ["--limit-mm-per-prompt", '{"image": 1, "video": 1}']
    yield from openai_server(args, log, timeout=120)


chat = partial(greedy_chat, model=NAME, logprobs=True)


def test_data_url_video_is_greedy_exact(client, path):
    frames = np.random.default_rng(7).integers(0, 256, (8, 16, 16, 3), dtype=np.uint8)
    data = mp4(frames)
    parts = [
        {"type": "video_url", "video_url": {"url": data_url(data)}},
        {"type": "text", "text": "What happens?"},
    ]
    out = chat(client, parts)
    text = f"<|im_start|>user\n{VIDEO}\nWhat happens?<|im_end|>\n<|im_start|>assistant\n"
    ids, tokens, logprobs = hf_mixed_greedy(path, text, [], [decoded(data)], MAX_NEW, RATE)
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids)  # 4 temporal patches x 2x2 merged tokens
    ours = [entry.logprob for entry in out.choices[0].logprobs.content]
    ref = [float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-4


def test_bad_videos_are_400_naming_them(client):
    small = mp4(np.zeros((2, 16, 16, 3), np.uint8))
    bomb = mp4(np.zeros((1, 4096, 4112, 3), np.uint8))  # ~180 KB, 16.8 M pixels a frame
    part = "messages[0].content[0].video_url"
    for parts, words in [
        ([data_url(bomb)], "4112x4096 pixel frames, more than the limit of 16777216"),
        ([data_url(b"not a video at all")], "The video cannot be read"),
        ([data_url(small, "image/png")], "media type 'image/png' is not a video"),
        ([data_url(small)] * 2, "2 videos, at most 1 per prompt (limit_mm_per_prompt)"),
        ([None], "A video_url part needs its video_url.url"),
    ]:
        content = [{"type": "video_url", "video_url": {"url": url}} for url in parts]
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, content)
        assert words in str(info.value), str(info.value)
        assert info.value.body["param"].startswith((part, "multi_modal_data"))
    out = chat(client, [{"type": "text", "text": "still serving"}])
    assert len(out.choices[0].model_extra["token_ids"]) == MAX_NEW


def test_without_pyav_a_video_file_is_refused_naming_the_extra(monkeypatch):
    import sys

    from trillm.engine.media import MultiModalInputError
    from trillm.engine.video_decode import decode_video

    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    with pytest.raises(MultiModalInputError, match=r"needs PyAV: install trillm\[video\]"):
        decode_video(b"\x00" * 64, "messages[0].content[0].video_url", 1 << 24)
