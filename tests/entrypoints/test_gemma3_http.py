"""Gemma 3 with images over HTTP with the official openai client: a chat with a data: URL image
part is greedy-exact vs transformers on the tiny Gemma 3, its template given the parts list
(``--chat-template-content-format auto``: the template loops over the content and writes
``<start_of_image>`` where the image part stands, as transformers' ``apply_chat_template``
renders it); the prompt tokens counted include the image's."""

from __future__ import annotations

import httpx
import openai
import pytest
from gemma3_reference import hf_greedy
from llava_reference import data_url, image, png
from server_harness import ServerProcess

NAME = "tiny-gemma3"
MAX_NEW = 8


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_gemma3 import build_tiny_gemma3

    return str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-http")))


IMG = image(21, (48, 40))
PARTS = [
    {"type": "text", "text": "Look:"},
    {"type": "image_url", "image_url": {"url": data_url(png(IMG))}},
    {"type": "text", "text": "What is this?"},
]


@pytest.fixture(scope="module")
def server(path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-gemma3") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "256"]
    args += ["--kv-cache-memory", "8MiB", "--distributed-executor-backend", "uni"]
    srv = ServerProcess(args, log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def chat(client, **extra):
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": PARTS}],
        max_tokens=MAX_NEW,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )


def test_data_url_image_chat_is_greedy_exact(client, path):
    from transformers import AutoTokenizer

    img, parts = IMG, PARTS
    out = chat(client)
    template_parts = [{"type": "text", "text": "Look:"}, {"type": "image"}, parts[2]]
    text = AutoTokenizer.from_pretrained(path).apply_chat_template(
        [{"role": "user", "content": template_parts}], tokenize=False, add_generation_prompt=True
    )
    assert "Look:<start_of_image>What is this?" in text  # no newline joins the parts
    ids, tokens, _ = hf_greedy(path, text, [img], MAX_NEW)
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids)  # the image's tokens counted


def test_tokenize_gives_the_chat_prompt_and_pan_and_scan_is_a_400(client, server):
    expected = chat(client).model_extra["prompt_token_ids"]
    body = {"model": NAME, "messages": [{"role": "user", "content": PARTS}]}
    got = httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()
    assert got["tokens"] == expected
    with pytest.raises(openai.BadRequestError, match="do_pan_and_scan"):
        chat(client, mm_processor_kwargs={"do_pan_and_scan": True})
