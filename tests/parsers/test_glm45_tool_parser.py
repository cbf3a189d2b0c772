"""The ``glm45`` tool parser (vLLM's name) on outputs as GLM-4.5 / 4.6's chat template (a
newline after the name) and GLM-4.7's (none) have them write calls: string parameters as
written, others as JSON, non-streamed and streamed at every split point alike; what does not
read as a call stays content."""

from __future__ import annotations

import pytest
from tool_call_streams import check_every_split, parse_calls

from trillm.parsers.tool_parsers import tool_parser_names

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "filters": {"type": "object"},
                    "code": {"type": "string"},
                },
            },
        },
    }
]


def glm45_call(name: str, *pairs: tuple[str, str]) -> str:
    args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return f"<tool_call>{name}\n{args}</tool_call>"


def glm47_call(name: str, *pairs: tuple[str, str]) -> str:
    args = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs)
    return f"<tool_call>{name}{args}</tool_call>"


SEARCH = ("query", 'café près de "Gare du Nord"'), ("limit", "5")
FILTERS = ("filters", '{"open": true, "price": {"max": 20}, "tags": ["wifi", "日本"]}')
EXPECTED_SEARCH = {"query": 'café près de "Gare du Nord"', "limit": 5}
EXPECTED_FILTERS = {"open": True, "price": {"max": 20}, "tags": ["wifi", "日本"]}
CASES = [
    (
        "Let me look that up.\n" + glm45_call("search", *SEARCH),
        ("Let me look that up.", [("search", EXPECTED_SEARCH)]),
    ),
    (
        glm45_call("search", ("query", "a"), FILTERS) + "\n" + glm45_call("get_time"),
        (None, [("search", {"query": "a", "filters": EXPECTED_FILTERS}), ("get_time", {})]),
    ),
    (
        "Checking." + glm47_call("search", *SEARCH) + glm47_call("search", ("code", " 42 ")),
        ("Checking.", [("search", EXPECTED_SEARCH), ("search", {"code": " 42 "})]),
    ),
    ("Plain answer, no tools.", ("Plain answer, no tools.", [])),
]


def test_registered_under_vllms_name():
    assert "glm45" in tool_parser_names()


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_calls_at_every_split(text, expected):
    check_every_split("glm45", text, expected, TOOLS)


def test_without_a_schema_values_read_as_json_else_text():
    text = glm45_call("f", ("n", "3"), ("xs", "[1, 2]"), ("s", "hello"), ("py", "{'a': 1}"))
    expected = {"n": 3, "xs": [1, 2], "s": "hello", "py": {"a": 1}}
    assert parse_calls("glm45", text) == (None, [("f", expected)])


MALFORMED = [
    "<tool_call>search(query='x')</tool_call>",  # not the tag format
    "<tool_call>search\nquery: x\n</tool_call>",  # no argument tags
    "<tool_call>search\n<arg_key>query</arg_key>\n</tool_call>",  # a key without its value
    "Sure.<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>x",  # cut off
]


@pytest.mark.parametrize("text", MALFORMED)
def test_what_does_not_read_as_a_call_stays_content(text):
    check_every_split("glm45", text, (text, []), TOOLS)
