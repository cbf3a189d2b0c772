"""The tool parsers whose calls are JSON objects in a family's own wrapping (vLLM's names):
``granite`` (Granite 3.0 / 3.1: an array, after ``<|tool_call|>`` or ``<tool_call>``),
``phi4_mini_json`` (``functools[...]``), ``internlm`` (InternLM2's plugin action tags) and
``jamba`` (an array in ``<tool_calls>`` tags), on outputs as their chat templates ask,
non-streamed and streamed at every split point alike; what does not read as calls stays
content."""

from __future__ import annotations

import pytest
from tool_call_streams import check_every_split

from trillm.parsers.tool_parsers import tool_parser_names

WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "q": "say \\"hi\\""}}'
NESTED = (
    '{"name": "plan", "arguments": {"steps": [{"do": "a", "with": {"x": [1, 2]}}], "note": "é]"}}'
)
CALLS = [
    ("get_weather", {"city": "Zürich", "q": 'say "hi"'}),
    ("plan", {"steps": [{"do": "a", "with": {"x": [1, 2]}}], "note": "é]"}),
]
INTERNLM_START, INTERNLM_END = "<|action_start|><|plugin|>", "<|action_end|>"

CASES = [
    ("granite", f"<|tool_call|>[{WEATHER}, {NESTED}]", (None, CALLS)),
    ("granite", f" <tool_call>[{WEATHER}]", (None, CALLS[:1])),
    ("granite", f"[{NESTED}]", (None, CALLS[1:])),
    ("granite", "The weather is sunny.", ("The weather is sunny.", [])),
    ("phi4_mini_json", f"functools[{WEATHER}, {NESTED}]", (None, CALLS)),
    ("phi4_mini_json", f"Let me check. functools[{NESTED}]", ("Let me check.", CALLS[1:])),
    (
        "phi4_mini_json",
        "I like Python's functools module.",
        ("I like Python's functools module.", []),
    ),
    (
        "internlm",
        f"Let me check.{INTERNLM_START}\n{WEATHER.replace('arguments', 'parameters')}{INTERNLM_END}",
        ("Let me check.", CALLS[:1]),
    ),
    (
        "internlm",
        f"{INTERNLM_START}\n{WEATHER}{INTERNLM_END}\n{INTERNLM_START}\n{NESTED}{INTERNLM_END}",
        (None, CALLS),
    ),
    (
        "jamba",
        f"Let me check.\n<tool_calls>[{WEATHER},\n {NESTED}]</tool_calls>",
        ("Let me check.", CALLS),
    ),
    ("jamba", "<tool_calls>[" + NESTED + "]</tool_calls>\nDone.", ("Done.", CALLS[1:])),
]
MALFORMED = [
    ("granite", '<|tool_call|>{"name": "f"}'),  # not an array
    ("granite", "[1, 2]"),
    ("phi4_mini_json", "functools[1, 2]"),
    ("internlm", f"{INTERNLM_START}\nget_weather(city='x'){INTERNLM_END}"),
    ("jamba", '<tool_calls>{"name": "f", "arguments": {}}</tool_calls>'),  # not an array
    ("jamba", "<tool_calls>[1]</tool_calls>"),
]


def test_registered_under_vllms_names():
    assert {"granite", "phi4_mini_json", "internlm", "jamba"} <= set(tool_parser_names())


@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_calls_at_every_split(name, text, expected):
    check_every_split(name, text, expected)


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_what_does_not_read_as_calls_stays_content(name, text):
    check_every_split(name, text, (text, []))
