"""The ``kimi_k2`` tool parser (vLLM's name) on outputs as Kimi K2's chat template has it
write calls, non-streamed and streamed at every split point alike; the model's
``functions.NAME:INDEX`` is the call's id (its template gives it back next turn); what does not
read as calls stays content."""

from __future__ import annotations

import pytest
from tool_call_streams import check_every_split, parse_calls

from trillm.parsers.tool_parsers import get_tool_parser, tool_parser_names

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def call(head: str, args: str) -> str:
    return f"<|tool_call_begin|>{head}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


CASES = [
    (
        "I'll check both cities."
        + BEGIN
        + call("functions.get_weather:0", '{"city": "北京"}')
        + call("functions.get_weather:1", '{"city": "Zürich", "unit": "celsius"}')
        + END,
        (
            "I'll check both cities.",
            [
                ("get_weather", {"city": "北京"}),
                ("get_weather", {"city": "Zürich", "unit": "celsius"}),
            ],
        ),
    ),
    (
        BEGIN
        + " "
        + call(
            " functions.run_code:0 ",
            ' {"code": "print(\\"}<|tool_call_end|>\\")", "opts": {"timeout": [1, 2]}} ',
        )
        + " "
        + END,
        (
            None,
            [("run_code", {"code": 'print("}<|tool_call_end|>")', "opts": {"timeout": [1, 2]}})],
        ),
    ),
    ("Hello! No tools needed.", ("Hello! No tools needed.", [])),
]
MALFORMED = [
    BEGIN + call("get_weather", '{"city": "Paris"}') + END,  # no index: not Kimi's head
    BEGIN + call("functions.get_weather:0", '"Paris"') + END,  # arguments not an object
    BEGIN + "I will call get_weather." + END,
]


def test_registered_under_vllms_name():
    assert "kimi_k2" in tool_parser_names()


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_calls_at_every_split(text, expected):
    check_every_split("kimi_k2", text, expected)


def test_the_models_id_is_the_calls_id_streamed_or_not():
    text = BEGIN + call("functions.get_weather:0", "{}") + call("functions.get_time:1", "{}") + END
    parser = get_tool_parser("kimi_k2")()
    ids = ["functions.get_weather:0", "functions.get_time:1"]
    assert [c.id for c in parser.extract(text).tool_calls] == ids
    streamer = parser.streamer()
    deltas = streamer.feed(text)[1] + streamer.finish()[1]
    assert [d["id"] for d in deltas if "id" in d] == ids


@pytest.mark.parametrize("text", MALFORMED)
def test_what_does_not_read_as_calls_stays_content(text):
    check_every_split("kimi_k2", text, (text, []))


def test_a_call_cut_off_by_max_tokens_is_content():
    text = "Sure." + BEGIN + call("functions.get_weather:0", '{"city": "Paris"}')[:-20]
    assert parse_calls("kimi_k2", text) == (text, [])
