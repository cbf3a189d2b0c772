"""Llama 4 with images over HTTP with the official openai client: a chat with a tiled image and
a one-tile image as data: URLs is greedy-exact vs transformers and its usage counts the
expanded prompt (tiles, separators, global tile); an image part over the limit is a 400 naming
the limit."""

from __future__ import annotations

from functools import partial

import openai
import pytest
from llama4_reference import IMAGE, hf_greedy
from llava_reference import chat_text, data_url, image, png
from mm_http import greedy_chat, openai_server

NAME = "tiny-llama4-vision"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_llama4 import build_tiny_llama4_conditional

    return str(build_tiny_llama4_conditional(tmp_path_factory.mktemp("tiny-llama4-http")))


@pytest.fixture(scope="module")
def client(path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-llama4-vision") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "256"]
    args += ["--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "16"]
    args += ["--limit-mm-per-prompt", '{"image": 2}', "--distributed-executor-backend", "uni"]
    yield from openai_server(args, log)


chat = partial(greedy_chat, model=NAME)


def test_image_url_parts_are_greedy_exact(client, path):
    imgs = [image(30, (90, 64)), image(31, (20, 20))]  # 2x2 tiles + global; one tile
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(i))}} for i in imgs]
    parts.append({"type": "text", "text": "Compare them."})
    out = chat(client, parts)
    ids, tokens, _ = hf_greedy(path, chat_text(path, f"{IMAGE}\n{IMAGE}\nCompare them."), imgs)
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids)  # the expanded spans counted


def test_more_images_than_the_limit_is_a_400(client):
    part = {"type": "image_url", "image_url": {"url": data_url(png(image(1, (20, 20))))}}
    with pytest.raises(openai.BadRequestError, match="at most 2"):
        chat(client, [part, part, part, {"type": "text", "text": "hi"}])
