"""``--reasoning-parser qwen3`` on a tokenizer without ``<think>`` / ``</think>`` tokens (e.g.
SmolLM2), as vLLM 0.32 serves it: the server starts, the tags are matched in the text, the
output starts in reasoning unless ``enable_thinking`` is false (then all of it is content),
and structured outputs, which wait for the end tag's token, are refused by name. Parsers that
work on the tags' token ids (deepseek_r1, step3, ...) still refuse the engine start
(tests/structured_output/test_structured_output_reasoning.py)."""

from __future__ import annotations

import openai
import pytest
from shared_servers import FAKE_RUNNER

from trillm.parsers.reasoning import get_reasoning_parser

# (chat_template_kwargs, output, reasoning, content): vLLM 0.32's Qwen3ParserReasoningAdapter
# on SmolLM2-135M-Instruct's tokenizer, extract_reasoning(output) as measured.
VLLM_032 = [
    ({}, "Hello there.", "Hello there.", None),
    ({}, "<think>a b</think>c d", "a b", "c d"),
    ({}, "x y</think>z", "x y", "z"),
    ({"enable_thinking": True}, "ünï</think>", "ünï", None),
    ({"enable_thinking": False}, "Hello there.", None, "Hello there."),
    ({"enable_thinking": False}, "<think>a b</think>c d", None, "<think>a b</think>c d"),
    ({"enable_thinking": False}, "x y</think>z", None, "x y</think>z"),
]


@pytest.mark.parametrize(("kwargs", "output", "reasoning", "content"), VLLM_032)
def test_split_as_vllm_without_tag_tokens(kwargs, output, reasoning, content):
    parser = get_reasoning_parser("qwen3")("", kwargs, False)
    assert parser.extract(output) == (reasoning, content)
    for cut in range(len(output) + 1):  # streamed in two deltas, at every split point
        streamer = get_reasoning_parser("qwen3")("", kwargs, False).streamer()
        parts = [streamer.feed(output[:cut]), streamer.feed(output[cut:]), streamer.finish()]
        got = "".join(p[0] for p in parts) or None, "".join(p[1] for p in parts) or None
        assert got == (reasoning, content), cut


def test_with_tag_tokens_the_split_is_unchanged():
    """With the tags as tokens, an untagged output of an untagged prompt stays content."""
    assert get_reasoning_parser("qwen3")("", {}).extract("Hello there.") == (None, "Hello there.")


@pytest.fixture(scope="module")
def server(shared_server):
    # the default tiny model: its tokenizer has no <think> / </think> tokens
    return shared_server([*FAKE_RUNNER, "--max-model-len", "256", "--reasoning-parser", "qwen3"])


def _client(srv) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    return client, client.models.list().data[0].id


def test_server_starts_and_files_the_output_as_reasoning(server):
    client, model = _client(server)
    ask = [{"role": "user", "content": "hi"}]
    body = dict(model=model, messages=ask, max_tokens=6, temperature=0)
    thinking = client.chat.completions.create(**body).choices[0].message  # type: ignore[call-overload]
    extra = thinking.model_extra or {}
    assert extra["reasoning_content"] and thinking.content is None
    plain = (
        client.chat.completions.create(  # type: ignore[call-overload]
            **body, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        .choices[0]
        .message
    )
    assert plain.content  # all of it content (the fake runner's tokens: not the same text)
    assert not (plain.model_extra or {}).get("reasoning_content")
    # the Responses API: one reasoning item, its tokens counted as reasoning
    resp = client.responses.create(model=model, input="hi", max_output_tokens=6)
    assert [item.type for item in resp.output] == ["reasoning"]
    assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens > 0


def test_structured_outputs_are_refused_by_name(server):
    client, model = _client(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
    assert "qwen3 reasoning parser" in err.value.message
    assert "<think>" in err.value.message
