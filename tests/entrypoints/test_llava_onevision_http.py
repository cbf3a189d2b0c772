"""LLaVA-OneVision over HTTP with the official openai client: a chat with two data: URL images
of different aspect ratios (each tiled at its own grid) is greedy-exact vs transformers, its
usage counts the expanded prompt; a ``video_url`` MP4 in a data: URL is greedy-exact too (PyAV,
the ``trillm[video]`` extra), and bytes that are no video are a 400 naming the problem."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from llava_reference import chat_text, data_url, image, png
from mm_http import MAX_NEW, greedy_chat, openai_server
from onevision_reference import IMAGE, VIDEO, hf_greedy, hf_video_greedy
from video_files import decoded, mp4, video_data_url

NAME = "tiny-onevision"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_llava_onevision import build_tiny_llava_onevision

    return str(build_tiny_llava_onevision(tmp_path_factory.mktemp("tiny-onevision-http")))


@pytest.fixture(scope="module")
def client(path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-onevision") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "512"]
    args += ["--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "32"]
    args += ["--limit-mm-per-prompt", '{"image": 2}', "--distributed-executor-backend", "uni"]
    yield from openai_server(args, log)


def chat(client, parts, **extra):
    return greedy_chat(client, parts, model=NAME, extra_body=extra)


def test_two_images_of_different_aspect_ratios_are_greedy_exact(client, path):
    imgs = [image(30, (90, 64)), image(31, (40, 90))]
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(i))}} for i in imgs]
    parts.append({"type": "text", "text": "Compare them."})
    out = chat(client, parts)
    ids, tokens, _ = hf_greedy(path, chat_text(path, f"{IMAGE}\n{IMAGE}\nCompare them."), imgs)
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids)  # the placeholders counted
    assert ids.count(4096) == 76 + 100


def test_a_video_url_part_is_greedy_exact(client, path):
    clip = np.random.default_rng(40).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    data = mp4(clip)  # skipped without PyAV
    parts = [{"type": "video_url", "video_url": {"url": video_data_url(data)}}]
    out = chat(client, [*parts, {"type": "text", "text": "What happens?"}])
    text = chat_text(path, f"{VIDEO}\nWhat happens?")
    ids, tokens, _ = hf_video_greedy(path, text, [], decoded(data))
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids) and ids.count(4097) == 3 * 4 + 1


def test_a_bad_video_part_is_a_400_naming_it(client):
    pytest.importorskip("av", reason="video files need PyAV (the trillm[video] extra)")
    part = {"type": "video_url", "video_url": {"url": video_data_url(b"not a video")}}
    with pytest.raises(openai.BadRequestError, match="The video cannot be read"):
        chat(client, [part, {"type": "text", "text": "What happens?"}])
    out = chat(client, [{"type": "text", "text": "still serving"}])
    assert len(out.choices[0].model_extra["token_ids"]) == MAX_NEW


def test_media_io_kwargs_choose_a_video_urls_frames(client, path):
    clip = np.random.default_rng(41).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    data = mp4(clip, rate=8)  # 1.5 seconds
    every = decoded(data)
    parts = [{"type": "video_url", "video_url": {"url": video_data_url(data)}}]
    parts.append({"type": "text", "text": "What happens?"})
    text = chat_text(path, f"{VIDEO}\nWhat happens?")
    # vLLM's choice: min(num_frames, frames, floor(seconds * fps)) spread first to last
    for options, kept in [
        ({"num_frames": 4}, [0, 3, 7, 11]),
        ({"fps": 2}, [0, 5, 11]),
        ({"num_frames": 5, "fps": 6}, [0, 2, 5, 8, 11]),  # fps allows 9, num_frames 5
        ({"num_frames": -1}, list(range(12))),
    ]:
        out = chat(client, parts, media_io_kwargs={"video": options})
        ids, tokens, _ = hf_video_greedy(path, text, [], every[kept])
        assert out.model_extra["prompt_token_ids"] == ids, options
        assert out.choices[0].model_extra["token_ids"] == tokens, options
        assert ids.count(4097) == len(kept) * 4 + 1


def test_media_io_kwargs_refusals(client):
    text = [{"type": "text", "text": "hi"}]
    for kwargs, words in [
        ({"video": {"backend": "opencv"}}, r"\['video'\]: 'backend' not implemented"),
        ({"image": {"rgba_background_color": [0, 0, 0]}}, r"\['image'\]: 'rgba_back"),
        ({"video": {"num_frames": 769}}, r"num_frames'\] must be a whole number in \[1, 768\]"),
        ({"video": {"num_frames": 0}}, r"num_frames'\] must be a whole number"),
        ({"video": {"fps": 0}}, r"\['fps'\] must be a number > 0 or -1"),
        ({"video": 8}, r"\['video'\] must be an object of options"),
    ]:
        with pytest.raises(openai.BadRequestError, match=words) as caught:
            chat(client, text, media_io_kwargs=kwargs)
        assert caught.value.body["param"] == "media_io_kwargs", kwargs
    out = chat(client, text, media_io_kwargs={"video": {"num_frames": 8}, "image": {}})
    assert len(out.choices[0].model_extra["token_ids"]) == MAX_NEW
