"""The ``deepseek_v3`` reasoning parser (vLLM's name; DeepSeek-V3.1 / V3.2's hybrid thinking):
with the request's ``chat_template_kwargs`` ``thinking: true`` the output splits as R1's does,
non-streamed and streamed at every split point alike; without it everything is content, tags
included. Where structured outputs start: the prompt's last tag, content when it has none."""

from __future__ import annotations

import pytest

from trillm.parsers.reasoning import ENDED, REASONING, get_reasoning_parser, reasoning_parser_names

PROMPT_THINKING = "<｜User｜>2 + 2?<｜Assistant｜><think>"
PROMPT_PLAIN = "<｜User｜>2 + 2?<｜Assistant｜></think>"
CASES = [
    ({"thinking": True}, PROMPT_THINKING, "Add them.</think>4", "Add them.", "4"),
    ({"thinking": True}, PROMPT_THINKING, "<think>Add them.</think>\n\n4", "Add them.", "\n\n4"),
    ({"thinking": True}, PROMPT_THINKING, "Still adding when cut", "Still adding when cut", None),
    ({}, PROMPT_PLAIN, "4", None, "4"),
    ({"thinking": False}, PROMPT_PLAIN, "<think>x</think>4", None, "<think>x</think>4"),
]


def parser(kwargs: dict, prompt: str):
    return get_reasoning_parser("deepseek_v3")(prompt, kwargs)


def stream(kwargs: dict, prompt: str, parts: list[str]) -> tuple[str | None, str | None]:
    streamer = parser(kwargs, prompt).streamer()
    reasoning = content = ""
    for part in [*parts, None]:
        r, c = streamer.feed(part) if part is not None else streamer.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


def test_registered_under_vllms_name():
    assert "deepseek_v3" in reasoning_parser_names()


@pytest.mark.parametrize(("kwargs", "prompt", "text", "reasoning", "content"), CASES)
def test_split_as_the_thinking_switch_says(kwargs, prompt, text, reasoning, content):
    assert parser(kwargs, prompt).extract(text) == (reasoning, content)
    for k in range(len(text) + 1):
        assert stream(kwargs, prompt, [text[:k], text[k:]]) == (reasoning, content), k


def test_structured_outputs_start_where_the_prompt_says():
    think, end = 7, 8  # the tags' token ids
    cls = get_reasoning_parser("deepseek_v3")
    assert cls.prompt_state([1, 2, think], (think, end)) == REASONING
    assert cls.prompt_state([1, think, 3, end], (think, end)) == ENDED
    assert cls.prompt_state([1, 2, 3], (think, end)) == ENDED  # no tag: not thinking
