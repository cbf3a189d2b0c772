"""Reasoning parsers on outputs as DeepSeek-R1 and Qwen3 write them, non-streamed and streamed
at every split point; with tool calls after the reasoning; include_reasoning. The HTTP side
(chat_template_kwargs' enable_thinking, stream deltas) is in test_tool_calling_http.py."""

from __future__ import annotations

import json

import pytest

from trillm.entrypoints.openai.endpoints.chat_parsing import ChoiceParser, ToolPlan
from trillm.parsers.reasoning import get_reasoning_parser, reasoning_parser_names
from trillm.parsers.tool_parsers import get_tool_parser

R1_FULL = (
    "<think>\nOkay, the user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n</think>"
    "\n\n17 × 23 = **391**."
)
R1_PROMPT_OPENED = "Okay, so 2 + 2.\nThat is 4.\n</think>\n\nThe answer is 4."
R1_CUT_OFF = "<think>\nOkay, let me think about this carefully. First"
QWEN3_THINKING = (
    "<think>\nThe user greets me. I should answer politely.\n</think>\n\nHello! How can I help?"
)
QWEN3_NO_THINKING = "Hello! How can I help you today?"
QWEN3_OPEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
QWEN3_CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

# (parser, rendered prompt, output, reasoning, content)
CASES = [
    (
        "deepseek_r1",
        "",
        R1_FULL,
        "\nOkay, the user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n",
        "\n\n17 × 23 = **391**.",
    ),
    (
        "deepseek_r1",
        "<think>\n",
        R1_PROMPT_OPENED,
        "Okay, so 2 + 2.\nThat is 4.\n",
        "\n\nThe answer is 4.",
    ),
    ("deepseek_r1", "", R1_CUT_OFF, "\nOkay, let me think about this carefully. First", None),
    (
        "qwen3",
        "",
        QWEN3_THINKING,
        "\nThe user greets me. I should answer politely.\n",
        "\n\nHello! How can I help?",
    ),
    ("qwen3", QWEN3_CLOSED_PROMPT, QWEN3_NO_THINKING, None, QWEN3_NO_THINKING),
    ("qwen3", "", QWEN3_NO_THINKING, None, QWEN3_NO_THINKING),
    (
        "qwen3",
        QWEN3_OPEN_PROMPT,
        "The user greets me.\n</think>\n\nHi!",
        "The user greets me.\n",
        "\n\nHi!",
    ),
    (
        "qwen3",
        QWEN3_OPEN_PROMPT,
        "Still thinking when max_tokens",
        "Still thinking when max_tokens",
        None,
    ),
]


def stream(name: str, prompt: str, parts: list[str]) -> tuple[str | None, str | None]:
    streamer = get_reasoning_parser(name)(prompt).streamer()
    reasoning = content = ""
    for part in parts:
        r, c = streamer.feed(part)
        reasoning, content = reasoning + r, content + c
    r, c = streamer.finish()
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_reasoning_parser_on_recorded_output(name, prompt, text, reasoning, content):
    assert get_reasoning_parser(name)(prompt).extract(text) == (reasoning, content)


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_streamed_at_every_split_point(name, prompt, text, reasoning, content):
    assert stream(name, prompt, list(text)) == (reasoning, content)
    for k in range(len(text) + 1):
        assert stream(name, prompt, [text[:k], text[k:]]) == (reasoning, content), k


def test_no_tag_text_leaks_while_streaming():
    streamer = get_reasoning_parser("qwen3")("").streamer()
    seen = []
    for ch in QWEN3_THINKING:
        seen.append(streamer.feed(ch))
    seen.append(streamer.finish())
    assert not any("<" in r or "<" in c for r, c in seen)
    first_content = next(i for i, (_, c) in enumerate(seen) if c)
    assert all(not r for r, _ in seen[first_content:])  # reasoning first, then content


def test_registry():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="Unknown reasoning parser"):
        get_reasoning_parser("nope")


# ---------------------------------------------------------------- with tools, per choice

QWEN3_THINK_THEN_CALL = (
    "<think>\nThe user wants the weather in Paris; I should call get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _choice_parser(include_reasoning: bool = True) -> ChoiceParser:
    hermes = get_tool_parser("hermes")
    qwen3 = get_reasoning_parser("qwen3")
    return ChoiceParser(
        ToolPlan("auto", [], lambda: hermes()), lambda: qwen3(""), include_reasoning
    )


def _streamed_message(parser: ChoiceParser, parts: list[str]) -> dict:
    msg: dict = {"reasoning_content": "", "content": "", "tool_calls": []}
    for i, part in enumerate(parts):
        delta = parser.feed(part, i == len(parts) - 1)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        msg["reasoning_content"] += delta.get("reasoning_content", "")
        msg["content"] += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:
                msg["tool_calls"].append({"name": d["function"]["name"], "arguments": ""})
            else:
                msg["tool_calls"][d["index"]]["arguments"] += d["function"]["arguments"]
    return msg


def test_reasoning_then_tool_call():
    parser = _choice_parser()
    msg = parser.message(QWEN3_THINK_THEN_CALL)
    assert (
        msg["reasoning_content"]
        == msg["reasoning"]
        == ("\nThe user wants the weather in Paris; I should call get_weather.\n")
    )
    assert msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert parser.finish_reason("stop") == "tool_calls"
    text = QWEN3_THINK_THEN_CALL
    for k in range(0, len(text) + 1, 3):
        streamed = _streamed_message(_choice_parser(), [text[:k], text[k:], ""])
        assert streamed["reasoning_content"] == msg["reasoning_content"], k
        assert streamed["content"] == "", k
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"]] == [
            ("get_weather", {"city": "Paris"})
        ], k


def test_include_reasoning_false_drops_it():
    msg = _choice_parser(include_reasoning=False).message(QWEN3_THINKING)
    assert msg["reasoning_content"] is None and msg["content"] == "\n\nHello! How can I help?"
    streamed = _streamed_message(
        _choice_parser(include_reasoning=False), list(QWEN3_THINKING) + [""]
    )
    assert (
        streamed["reasoning_content"] == "" and streamed["content"] == "\n\nHello! How can I help?"
    )


def test_constrained_tool_output_is_split_after_its_reasoning():
    # The engine constrains a required / named output only after </think> (same parser), so
    # the reasoning comes off first and the content is the constrained JSON (as in vLLM).
    from trillm.entrypoints.openai.endpoints.chat_parsing import plan_tools
    from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest
    from trillm.entrypoints.openai.schemas.structuring import structure

    class State:
        enable_auto_tool_choice, tool_call_parser = True, "hermes"
        exclude_tools_when_tool_choice_none, reasoning_parser = False, "deepseek_r1"

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    plan = plan_tools(State(), structure(ChatCompletionRequest, body))
    r1 = get_reasoning_parser("deepseek_r1")
    msg = ChoiceParser(plan, lambda: r1(""), True).message('plan it</think>{"a": 1}')
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert msg["reasoning_content"] == "plan it"
    # A prompt that closed the reasoning: constrained from the first token, all content.
    closed = ChoiceParser(plan, lambda: r1("<think>\n\n</think>\n\n"), True)
    msg = closed.message('{"a": 1}')
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert msg["reasoning_content"] is None
    stream = ChoiceParser(plan, lambda: r1(""), True)
    deltas = [stream.feed(t, False) for t in ("pl", "an</th", 'ink>{"a"', ": 1}")]
    deltas.append(stream.feed("", True))
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan"
    args = "".join(
        c["function"].get("arguments") or "" for d in deltas for c in d.get("tool_calls", [])
    )
    assert args == '{"a": 1}'


def test_the_tags_cache_lets_its_tokenizers_go(monkeypatch):
    """Whether a tokenizer has a parser's tags is read once per tokenizer, and the cache does
    not keep the tokenizer alive (an in-process server's goes with it)."""
    import gc
    import weakref

    from trillm.engine.tokenizer_loader import load_tokenizer
    from trillm.entrypoints.openai.endpoints.chat_parsing import _tags_are_tokens
    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    cls = get_reasoning_parser("deepseek_r1")
    tokenizer = load_tokenizer(str(DEFAULT_MODEL_DIR))
    vocab = tokenizer.get_vocab()
    has_tags = "<think>" in vocab and "</think>" in vocab
    reads = []
    get_vocab = type(tokenizer).get_vocab
    monkeypatch.setattr(
        type(tokenizer), "get_vocab", lambda self: reads.append(1) or get_vocab(self)
    )
    assert _tags_are_tokens(cls, tokenizer) is _tags_are_tokens(cls, tokenizer) is has_tags
    assert len(reads) == 1
    gone = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert gone() is None
