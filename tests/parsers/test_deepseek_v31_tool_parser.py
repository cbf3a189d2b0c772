"""The ``deepseek_v31`` tool parser (vLLM's name) on outputs as DeepSeek-V3.1's chat template
has it write calls (V3's tags, no ``function`` type and no JSON fences), non-streamed and
streamed at every split point alike; what does not read as calls stays content."""

from __future__ import annotations

import pytest
from tool_call_streams import check_every_split, parse_calls

from trillm.parsers.tool_parsers import tool_parser_names

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


CASES = [
    (
        "Let me check." + BEGIN + call("get_weather", '{"city": "Paris"}') + END,
        ("Let me check.", [("get_weather", {"city": "Paris"})]),
    ),
    (
        BEGIN
        + call("run", '{"code": "x = {1: \\"}\\"}", "city": "Zürich", "n": [1, {"a": null}]}')
        + call("get_time", "{}")
        + END,
        (
            None,
            [
                ("run", {"code": 'x = {1: "}"}', "city": "Zürich", "n": [1, {"a": None}]}),
                ("get_time", {}),
            ],
        ),
    ),
    ("Just text, no calls.", ("Just text, no calls.", [])),
]
MALFORMED = [
    BEGIN + call("", "{}") + END,  # no name
    BEGIN + call("get_weather", "[1, 2]") + END,  # arguments not an object
    BEGIN + "<｜tool▁call▁begin｜>get_weather" + '{"city": "Paris"}<｜tool▁call▁end｜>' + END,
    BEGIN + "I will call get_weather." + END,
]


def test_registered_under_vllms_name():
    assert "deepseek_v31" in tool_parser_names()


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_calls_at_every_split(text, expected):
    check_every_split("deepseek_v31", text, expected)


@pytest.mark.parametrize("text", MALFORMED)
def test_what_does_not_read_as_calls_stays_content(text):
    check_every_split("deepseek_v31", text, (text, []))


def test_v3s_fenced_calls_are_not_v31s():
    v3 = (
        BEGIN
        + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>"
        + END
    )
    assert parse_calls("deepseek_v31", v3) == (v3, [])
