"""The ``minimax_m2`` tool parser (vLLM's name) on outputs as MiniMax-M2's chat template has
it write calls (several invokes a block), values typed by the tools' JSON schemas,
non-streamed and streamed at every split point alike; what does not read as calls stays
content."""

from __future__ import annotations

import pytest
from tool_call_streams import check_every_split, parse_calls

from trillm.parsers.tool_parsers import tool_parser_names

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "hotel": {"type": "string"},
                    "nights": {"type": "integer"},
                    "breakfast": {"type": "boolean"},
                    "guests": {"type": "array"},
                    "budget": {"type": ["number", "null"]},
                    "room": {"enum": ["single", "double"]},
                },
            },
        },
    }
]


def invoke(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params)
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


BOOK = (
    ("hotel", 'Hôtel "Le Petit"'),
    ("nights", "3"),
    ("breakfast", "yes"),
    ("guests", '[{"name": "Zoë", "age": 31}, {"name": "李", "age": 4}]'),
    ("budget", "null"),
    ("room", "double"),
)
EXPECTED_BOOK = {
    "hotel": 'Hôtel "Le Petit"',
    "nights": 3,
    "breakfast": True,
    "guests": [{"name": "Zoë", "age": 31}, {"name": "李", "age": 4}],
    "budget": None,
    "room": "double",
}
CASES = [
    (
        "I'll book it and check the time.\n" + block(invoke("book", *BOOK), invoke("get_time")),
        ("I'll book it and check the time.", [("book", EXPECTED_BOOK), ("get_time", {})]),
    ),
    (
        block(invoke("book", ("nights", "\n2\n"), ("budget", "120.5"))) + "\nBooked.",
        ("Booked.", [("book", {"nights": 2, "budget": 120.5})]),
    ),
    ("No booking needed.", ("No booking needed.", [])),
]
MALFORMED = [
    "<minimax:tool_call>\nbook(hotel='x')\n</minimax:tool_call>",  # not invokes
    '<minimax:tool_call>\n<invoke name="book">\nhotel: x\n</invoke>\n</minimax:tool_call>',
    "<minimax:tool_call>\n</minimax:tool_call>",  # no invoke
]


def test_registered_under_vllms_name():
    assert "minimax_m2" in tool_parser_names()


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_calls_typed_by_schema_at_every_split(text, expected):
    check_every_split("minimax_m2", text, expected, TOOLS)


def test_without_a_schema_values_are_text_but_null():
    text = block(invoke("f", ("n", "3"), ("x", "none")))
    assert parse_calls("minimax_m2", text) == (None, [("f", {"n": "3", "x": None})])


@pytest.mark.parametrize("text", MALFORMED)
def test_what_does_not_read_as_calls_stays_content(text):
    check_every_split("minimax_m2", text, (text, []), TOOLS)


def test_a_block_cut_off_by_max_tokens_is_content():
    text = "Sure." + block(invoke("book", ("nights", "3")))[:-25]
    assert parse_calls("minimax_m2", text, TOOLS) == (text, [])
