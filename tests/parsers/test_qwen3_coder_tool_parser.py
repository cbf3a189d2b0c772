"""The ``qwen3_coder`` tool parser (also ``qwen3_xml``: vLLM's names) on outputs as
Qwen3-Coder's chat template has it write calls: values typed by the tools' JSON schemas,
non-streamed and streamed at every split point alike; what does not read as a call stays
content."""

from __future__ import annotations

import pytest
from tool_call_streams import check_every_split, parse_calls

from trillm.parsers.tool_parsers import get_tool_parser, tool_parser_names

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "threshold": {"type": "number"},
                    "unit": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "options": {"type": "object"},
                    "tags": {"type": "array"},
                },
            },
        },
    },
]


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CASES = [
    (
        "I'll check the weather.\n\n"
        + call("get_weather", ("city", "Zürich"), ("days", "3"), ("metric", "true"))
        + "\n"
        + call("get_weather", ("city", "São Paulo"), ("threshold", "2.5"), ("unit", "null")),
        (
            "I'll check the weather.",
            [
                ("get_weather", {"city": "Zürich", "days": 3, "metric": True}),
                ("get_weather", {"city": "São Paulo", "threshold": 2.5, "unit": None}),
            ],
        ),
    ),
    (
        call(
            "write_file",
            ("path", "a.py"),
            ("content", 'print("<b>{x}</b> is \\"quoted\\"")\n\nx = {1: 2}'),
            ("options", '{"mode": "w", "nested": {"list": [1, "два"]}}'),
            ("tags", "['py', 'new']"),
        ),
        (
            None,
            [
                (
                    "write_file",
                    {
                        "path": "a.py",
                        "content": 'print("<b>{x}</b> is \\"quoted\\"")\n\nx = {1: 2}',
                        "options": {"mode": "w", "nested": {"list": [1, "два"]}},
                        "tags": ["py", "new"],
                    },
                )
            ],
        ),
    ),
    (  # a parameter the schema does not name is a string; a tool with no parameters
        call("get_weather", ("city", "Oslo"), ("extra", "42"))
        + "\n"
        + call("get_time")
        + "\nDone.",
        ("Done.", [("get_weather", {"city": "Oslo", "extra": "42"}), ("get_time", {})]),
    ),
    ("No tools needed: 2 + 2 = 4.", ("No tools needed: 2 + 2 = 4.", [])),
]


def test_registered_under_vllms_names():
    assert {"qwen3_coder", "qwen3_xml"} <= set(tool_parser_names())


@pytest.mark.parametrize("name", ["qwen3_coder", "qwen3_xml"])
@pytest.mark.parametrize(("text", "expected"), CASES)
def test_calls_typed_by_schema_at_every_split(name, text, expected):
    check_every_split(name, text, expected, TOOLS)


def test_content_between_calls_is_kept():
    text = "First:" + call("get_time") + "then:" + call("get_time")
    assert parse_calls("qwen3_coder", text, TOOLS) == ("First:then:", [("get_time", {})] * 2)


def test_without_tools_every_value_is_a_string():
    text = call("get_weather", ("days", "3"))
    assert parse_calls("qwen3_coder", text) == (None, [("get_weather", {"days": "3"})])


MALFORMED = [
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # not the XML format
    "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
    "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",  # no tags
]


@pytest.mark.parametrize("text", MALFORMED)
def test_what_does_not_read_as_a_call_stays_content(text):
    check_every_split("qwen3_coder", text, (text, []), TOOLS)


def test_a_call_cut_off_by_max_tokens():
    """Non-streamed the output is content (as for the other parsers); streamed, the call was
    announced with its name and cannot be taken back."""
    text = "Sure." + call("get_weather", ("city", "Paris"), ("days", "3"))[:-40]
    assert parse_calls("qwen3_coder", text, TOOLS) == (text, [])
    streamer = get_tool_parser("qwen3_coder")(TOOLS).streamer()
    deltas = streamer.feed(text)[1] + streamer.finish()[1]
    assert deltas[0]["function"]["name"] == "get_weather"
