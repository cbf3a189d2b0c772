"""A chat ``image_url`` part over HTTP with the official openai client on the tiny Qwen2.5-VL:
a data: URL image is greedy-exact vs transformers (its part rendered as
``<|vision_start|><|image_pad|><|vision_end|>``, expanded to the image's merged patches),
``mm_processor_kwargs`` sets the pixel budget, and a key the tower fixes is a 400 naming it."""

from __future__ import annotations

from functools import partial

import openai
import pytest
from llava_reference import data_url, image, png
from mm_http import MAX_NEW, greedy_chat, openai_server
from qwen2_vl_reference import IMAGE, hf_greedy

NAME = "tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_qwen2_vl import build_tiny_qwen2_vl

    return str(build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), version="2.5"))


@pytest.fixture(scope="module")
def client(path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-qwen2-vl") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "256"]
    args += ["--kv-cache-memory", "8MiB", "--max-num-seqs", "4"]
    args += ["--distributed-executor-backend", "uni", "--max-num-batched-tokens", "16"]
    yield from openai_server(args, log, timeout=120)


chat = partial(greedy_chat, model=NAME, logprobs=True)


def test_data_url_image_is_greedy_exact_and_refusals_name_the_key(client, path):
    img = image(11, (56, 40))
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(png(img))}},
        {"type": "text", "text": "What is this?"},
    ]
    text = f"<|im_start|>user\n{IMAGE}\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
    for kwargs, hf_kwargs in [
        (None, {}),
        ({"max_pixels": 32 * 32}, {"size": {"shortest_edge": 256, "longest_edge": 1024}}),
    ]:
        out = chat(client, parts, extra_body={"mm_processor_kwargs": kwargs} if kwargs else None)
        ids, tokens, logprobs = hf_greedy(path, text, [img], MAX_NEW, **hf_kwargs)
        assert out.model_extra["prompt_token_ids"] == ids
        assert out.choices[0].model_extra["token_ids"] == tokens
        assert out.usage.prompt_tokens == len(ids)  # the placeholders counted
        ours = [entry.logprob for entry in out.choices[0].logprobs.content]
        ref = [float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(tokens)]
        assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-4
    with pytest.raises(openai.BadRequestError, match="'merge_size' is the vision tower's own"):
        chat(client, parts, extra_body={"mm_processor_kwargs": {"merge_size": 1}})
    out = chat(client, [{"type": "text", "text": "still serving"}])
    assert len(out.choices[0].model_extra["token_ids"]) == MAX_NEW
