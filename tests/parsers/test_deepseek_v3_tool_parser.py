"""The ``deepseek_v3`` tool-call parser (vLLM's name) on outputs as DeepSeek-V3 / R1's chat
template has them write calls: non-streamed and streamed at every split point alike; blocks
that do not read as calls, and calls cut off by max_tokens, stay content. Linear streaming is
checked with the other parsers' (test_tool_parser_incremental.py)."""

from __future__ import annotations

import pytest
from tool_call_streams import parse_calls, stream_calls

from trillm.parsers.tool_parsers import get_tool_parser, tool_parser_names

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
SEP = "<｜tool▁sep｜>"


def call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function{SEP}{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


CASES = [
    (
        "Let me check." + BEGIN + call("get_weather", '{"city": "Paris"}') + END,
        "Let me check.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        BEGIN
        + call("run", '{\n  "code": "x = {1: \\"}\\"}",\n  "city": "Zürich"\n}')
        + "\n"
        + call("get_time", "{}")
        + END,
        None,
        [("run", {"code": 'x = {1: "}"}', "city": "Zürich"}), ("get_time", {})],
    ),
    ("Just text, no calls.", "Just text, no calls.", []),
]
MALFORMED = [
    BEGIN + f"<｜tool▁call▁begin｜>function{SEP}get_weather\n" + '{"city": "Paris"}' + END,
    BEGIN + call("", "{}") + END,  # no name
    BEGIN + call("get_weather", "[1, 2]") + END,  # arguments not an object
    BEGIN + "I will call get_weather." + END,
]


PARSER = "deepseek_v3"


def test_registered_under_vllms_name():
    assert "deepseek_v3" in tool_parser_names()


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_calls_non_streamed_and_streamed_at_every_split(text, content, calls):
    assert parse_calls(PARSER, text) == (content, calls)
    assert stream_calls(PARSER, list(text)) == (content, calls)
    for k in range(len(text) + 1):
        assert stream_calls(PARSER, [text[:k], text[k:]]) == (content, calls), k


@pytest.mark.parametrize("text", MALFORMED)
def test_what_does_not_read_as_calls_stays_content(text):
    assert parse_calls(PARSER, text) == (text, [])
    for k in range(len(text) + 1):
        assert stream_calls(PARSER, [text[:k], text[k:]]) == (text, []), k


def test_a_call_cut_off_by_max_tokens():
    """Non-streamed the output is content (vLLM's rule for the other parsers too); streamed,
    the call was announced with its name and cannot be taken back."""
    text = "Sure." + BEGIN + call("get_weather", '{"city": "Paris"}')[:-25]
    assert parse_calls(PARSER, text) == (text, [])
    streamer = get_tool_parser("deepseek_v3")().streamer()
    deltas = streamer.feed(text)[1] + streamer.finish()[1]
    assert deltas[0]["function"]["name"] == "get_weather"
