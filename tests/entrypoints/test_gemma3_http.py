"""Gemma 3 with images over HTTP with the official openai client: a chat with a data: URL image
part is greedy-exact vs transformers on the tiny Gemma 3, its template given the parts list
(``--chat-template-content-format auto``: the template loops over the content and writes
``<start_of_image>`` where the image part stands, as transformers' ``apply_chat_template``
renders it); the prompt tokens counted include the image's."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def client(path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-gemma3") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "256"]
    args += ["--kv-cache-memory", "8MiB", "--distributed-executor-backend", "uni"]
    srv = ServerProcess(args, log).start()
    try:
        with openai.OpenAI(
            base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120
        ) as client:
            yield client
    finally:
        assert srv.stop() == 0, srv.log()


def test_data_url_image_chat_is_greedy_exact(client, path):
    from transformers import AutoTokenizer

    img = image(21, (48, 40))
    parts = [
        {"type": "text", "text": "Look:"},
        {"type": "image_url", "image_url": {"url": data_url(png(img))}},
        {"type": "text", "text": "What is this?"},
    ]
    out = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_NEW,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    template_parts = [{"type": "text", "text": "Look:"}, {"type": "image"}, parts[2]]
    text = AutoTokenizer.from_pretrained(path).apply_chat_template(
        [{"role": "user", "content": template_parts}], tokenize=False, add_generation_prompt=True
    )
    assert "Look:<start_of_image>What is this?" in text  # no newline joins the parts
    ids, tokens, _ = hf_greedy(path, text, [img], MAX_NEW)
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids)  # the image's tokens counted
