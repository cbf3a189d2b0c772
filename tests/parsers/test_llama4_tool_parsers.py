"""vLLM's Llama 4 tool-call parser names: ``llama4_pythonic`` reads Llama 4's pythonic calls
(inside ``<|python_start|>`` / ``<|python_end|>`` or bare), ``llama4_json`` its JSON calls,
whole and streamed a character at a time; other output stays content."""

from __future__ import annotations

import json

import pytest
from tool_call_streams import stream_calls

from trillm.parsers.tool_parsers import get_tool_parser, tool_parser_names

PYTHONIC = (
    '<|python_start|>[get_weather(city="Paris", unit="celsius"), get_time(tz="CET")]<|python_end|>'
)
CASES = [
    (
        "llama4_pythonic",
        PYTHONIC,
        None,
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "CET"})],
    ),
    ("llama4_pythonic", '[get_time(tz="CET")]', None, [("get_time", {"tz": "CET"})]),
    ("llama4_pythonic", "It is 20 degrees.", "It is 20 degrees.", []),
    (
        "llama4_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    ("llama4_json", "Paris is sunny today.", "Paris is sunny today.", []),
]


def test_the_names_are_registered():
    assert {"llama4_pythonic", "llama4_json"} <= set(tool_parser_names())


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_output(name, text, content, calls):
    result = get_tool_parser(name)().extract(text)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_a_character_at_a_time(name, text, content, calls):
    streamed, found = stream_calls(name, list(text))
    assert streamed == content
    assert found == calls
