"""gpt-oss's harmony outputs: the ``openai_gptoss`` (``gpt_oss``) reasoning parser (analysis
channel -> reasoning, final and preambles -> content, tool messages kept for the tool parser)
and the ``openai`` tool parser (``to=functions.NAME`` messages -> calls), non-streamed and
streamed at every split point, alone and together per chat choice; both keep special tokens;
structured outputs with the reasoning parser are refused by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import trio
from tool_call_streams import parse_calls, stream_calls

from trillm.entrypoints.openai.endpoints.chat_parsing import (
    ChoiceParser,
    ToolPlan,
    keeps_special_tokens,
)
from trillm.parsers.reasoning import get_reasoning_parser, reasoning_parser_names
from trillm.parsers.tool_parsers import get_tool_parser, tool_parser_names
from trillm.sampling_params import StructuredOutputsParams
from trillm.structured_output.manager import StructuredOutputManager
from trillm.structured_output.spec import StructuredOutputError

ANALYSIS = "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
TWO_CALLS = CALL + CALL.replace("get_weather", "get_time").replace('"city"', '"zone"')

REASONING_CASES = [
    # text, reasoning, content
    (ANALYSIS + FINAL, "The user greets; answer briefly.", "Hello! How can I help?"),
    (ANALYSIS + FINAL + "<|return|>", "The user greets; answer briefly.", "Hello! How can I help?"),
    ("<|channel|>analysis<|message|>Still thinking", "Still thinking", None),  # cut off
    (
        ANALYSIS + ANALYSIS.replace("greets", "waits"),
        "The user greets; answer briefly.\nThe user waits; answer briefly.",  # newline-joined
        None,
    ),
    (ANALYSIS + CALL, "The user greets; answer briefly.", CALL),
    (PREAMBLE + CALL, None, "Checking the weather." + CALL),
    ("plain text, no harmony", None, "plain text, no harmony"),
]

TOOL_CASES = [
    # text (after the reasoning parser, or raw), content, calls
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    (TWO_CALLS, None, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Paris"})]),
    ("Checking the weather." + CALL, "Checking the weather.", [("get_weather", {"city": "Paris"})]),
    (CALL[: -len("<|call|>")], None, [("get_weather", {"city": "Paris"})]),  # stopped at <|call|>
    (FINAL, "Hello! How can I help?", []),
    (
        "<|channel|>commentary to=browser.search<|message|>query<|end|>",
        "query",  # not a function tool: its body is content
        [],
    ),
]


def stream_reasoning(name: str, parts: list[str]) -> tuple[str | None, str | None]:
    streamer = get_reasoning_parser(name)("").streamer()
    reasoning, content = "", ""
    for part in parts:
        r, c = streamer.feed(part)
        reasoning, content = reasoning + r, content + c
    r, c = streamer.finish()
    return (reasoning + r) or None, (content + c) or None


def test_both_names_are_registered():
    assert {"openai_gptoss", "gpt_oss"} <= set(reasoning_parser_names())
    assert "openai" in tool_parser_names()


@pytest.mark.parametrize("name", ["openai_gptoss", "gpt_oss"])
@pytest.mark.parametrize("text,reasoning,content", REASONING_CASES)
def test_reasoning_parser(name, text, reasoning, content):
    assert get_reasoning_parser(name)("").extract(text) == (reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", REASONING_CASES)
def test_reasoning_streamed_at_every_split_point(text, reasoning, content):
    assert stream_reasoning("openai_gptoss", list(text)) == (reasoning, content)
    for k in range(len(text) + 1):
        assert stream_reasoning("openai_gptoss", [text[:k], text[k:]]) == (reasoning, content), k


def test_no_marker_leaks_while_streaming():
    streamer = get_reasoning_parser("openai_gptoss")("").streamer()
    seen = [streamer.feed(ch) for ch in ANALYSIS + FINAL] + [streamer.finish()]
    assert not any("<|" in r or "<|" in c or r.endswith("<") or c.endswith("<") for r, c in seen)


@pytest.mark.parametrize("text,content,calls", TOOL_CASES)
def test_tool_parser(text, content, calls):
    assert parse_calls("openai", text) == (content, calls)


@pytest.mark.parametrize("text,content,calls", TOOL_CASES)
def test_tool_parser_streamed_at_every_split_point(text, content, calls):
    assert stream_calls("openai", list(text)) == (content, calls)
    for k in range(len(text) + 1):
        assert stream_calls("openai", [text[:k], text[k:]]) == (content, calls), k


def _choice_parser() -> ChoiceParser:
    tool, reasoning = get_tool_parser("openai"), get_reasoning_parser("openai_gptoss")
    return ChoiceParser(ToolPlan("auto", [], lambda: tool()), lambda: reasoning(""), True)


def test_a_choice_through_both_parsers():
    text = ANALYSIS + PREAMBLE + CALL
    parser = _choice_parser()
    msg = parser.message(text)
    assert msg["reasoning_content"] == msg["reasoning"] == "The user greets; answer briefly."
    assert msg["content"] == "Checking the weather."
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
    ] == [("get_weather", {"city": "Paris"})]
    assert parser.finish_reason("stop") == "tool_calls"
    for k in range(0, len(text) + 1, 5):
        streamed = _choice_parser()
        reasoning, content, calls = "", "", []
        for i, part in enumerate([text[:k], text[k:], ""]):
            delta = streamed.feed(part, i == 2)
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            for d in delta.get("tool_calls", []):
                if "id" in d:
                    calls.append([d["function"]["name"], ""])
                else:
                    calls[d["index"]][1] += d["function"]["arguments"]
        assert (reasoning, content) == (msg["reasoning_content"], msg["content"]), k
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})], k


def test_harmony_markers_keep_special_tokens():
    tokenizer = SimpleNamespace(
        all_special_tokens=["<|start|>", "<|channel|>", "<|message|>"], added_tokens_decoder={}
    )
    openai = ToolPlan("auto", [], lambda: get_tool_parser("openai")())
    assert keeps_special_tokens(tokenizer, openai, reasoning=False)
    assert keeps_special_tokens(tokenizer, ToolPlan(), reasoning=True)
    assert not keeps_special_tokens(tokenizer, ToolPlan(), reasoning=False)


@pytest.mark.parametrize("name", ["openai_gptoss", "gpt_oss"])
def test_structured_outputs_with_the_harmony_reasoning_parser_are_refused(name):
    manager = StructuredOutputManager(SimpleNamespace(tokenizer=None, vocab_size=64), name)
    with pytest.raises(StructuredOutputError, match="openai_gptoss reasoning parser") as err:
        trio.run(manager.precompile, StructuredOutputsParams(json={"type": "object"}))
    assert err.value.param == "structured_outputs"
