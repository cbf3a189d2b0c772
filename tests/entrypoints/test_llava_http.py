"""Chat ``image_url`` parts over HTTP with the official openai client: a data: URL image is
greedy-exact vs transformers on the tiny LLaVA (the prompt the chat template renders, with
the image part as ``<image>``), and every bad image part is a 400 naming it while the server
keeps serving."""

from __future__ import annotations

import openai
import pytest
from llava_reference import data_url, hf_llava_greedy, image, png, png_claiming
from server_harness import ServerProcess

NAME = "tiny-llava"
MAX_NEW = 8


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-http")))


@pytest.fixture(scope="module")
def client(llava_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-llava") / "server.log"
    args = [llava_path, "--served-model-name", NAME, "--max-model-len", "256"]
    args += [
        "--kv-cache-memory",
        "8MiB",
        "--max-num-seqs",
        "4",
        "--distributed-executor-backend",
        "uni",
    ]
    srv = ServerProcess(args, log).start()
    yield openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    assert srv.stop() == 0, srv.log()


def chat(client, parts, **kwargs):
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_NEW,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **kwargs,
    )


def test_data_url_image_is_greedy_exact(client, llava_path):
    from transformers import AutoTokenizer

    img = image(11)
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(png(img))}},
        {"type": "text", "text": "What is this?"},
    ]
    out = chat(client, parts)
    tok = AutoTokenizer.from_pretrained(llava_path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat is this?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids, tokens = hf_llava_greedy(llava_path, text, [img], MAX_NEW)
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids)  # the placeholders counted


def test_bad_image_parts_are_400_naming_them(client):
    good = png(image(12))
    cases = [
        ("https://example.com/cat.png", "not fetched yet"),
        ("file:///etc/hostname", "--allowed-local-media-path"),
        ("data:image/png;base64,%%%not-base64", "not valid base64"),
        (data_url(good, "text/plain"), "is not an image"),
        (data_url(b"\x00garbage bytes"), "cannot be read as an image"),
        (data_url(good[:200]), "cannot be decoded"),  # a PNG header, then too little data
        (data_url(png_claiming(4200, 4200)), "more than the limit of 16777216"),
        (data_url(png_claiming(50_000, 50_000)), "more pixels than the limit"),  # PIL's bomb
    ]
    for url, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, [{"type": "image_url", "image_url": {"url": url}}])
        assert words in str(info.value), (url[:40], str(info.value))
    two = [{"type": "image_url", "image_url": {"url": data_url(good)}}] * 2
    with pytest.raises(openai.BadRequestError, match="at most 1 per prompt"):
        chat(client, two)
    out = chat(client, [{"type": "text", "text": "still serving"}])
    assert len(out.choices[0].model_extra["token_ids"]) == MAX_NEW
