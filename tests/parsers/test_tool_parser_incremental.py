"""Streamed tool-call parsing costs time linear in the output (issue 33, found by hostile
requests): the streamer split the whole text again after every delta, so a pythonic stream of
many calls took twice as long as the same tokens without a parser. Now each built-in parser
resumes after its last complete call (``ToolParser.split_tail``).

Work is counted, not timed: the characters given to the parser over a whole stream. And what
the stream sends is exactly what splitting the whole text after every delta sends."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from trillm.parsers.tool_parsers import RequiredToolCallParser, ToolParser, get_tool_parser


def _hermes(n: int) -> str:
    calls = "".join(
        f'<tool_call>\n{{"name": "f{i}", "arguments": {{"x": {i}, "s": "a b"}}}}\n</tool_call>\n'
        for i in range(n)
    )
    return "Let me check.\n" + calls + "Done."


def _hermes_then_text(n: int) -> str:
    """A long answer after the calls: content is settled too, not split again."""
    return _hermes(2) + "The weather is fine. \n" * (n * 4)


def _llama3(n: int) -> str:
    return "<|python_tag|>" + "; ".join(
        f'{{"name": "f{i}", "parameters": {{"x": {i}, "s": "a; b"}}}}' for i in range(n)
    )


def _mistral_array(n: int) -> str:
    calls = ", ".join(f'{{"name": "f{i}", "arguments": {{"x": [{i}, "]"]}}}}' for i in range(n))
    return "Sure. [TOOL_CALLS][" + calls + "]</s>"


def _mistral_v11(n: int) -> str:
    return "".join(f'[TOOL_CALLS]f{i}[ARGS]{{"x": {i}, "s": "{{"}}' for i in range(n)) + "</s>"


def _pythonic(n: int) -> str:
    return "[" + ", ".join(f'f{i}(x={i}, s="a, (b)", l=[1, 2])' for i in range(n)) + "]"


def _deepseek_v3(n: int) -> str:
    calls = "".join(
        f'<｜tool▁call▁begin｜>function<｜tool▁sep｜>f{i}\n```json\n{{"x": {i}, "s": "`"}}\n```'
        "<｜tool▁call▁end｜>"
        for i in range(n)
    )
    return "Let me check.<｜tool▁calls▁begin｜>" + calls + "<｜tool▁calls▁end｜>"


def _qwen3_coder(n: int) -> str:
    calls = "".join(
        f"<tool_call>\n<function=f{i}>\n<parameter=x>\n{i}\n</parameter>\n</function>\n</tool_call>\n"
        for i in range(n)
    )
    return "Let me check.\n" + calls


def _glm45(n: int) -> str:
    return "".join(
        f"<tool_call>f{i}\n<arg_key>x</arg_key>\n<arg_value>{i}</arg_value>\n</tool_call>"
        for i in range(n)
    )


def _minimax_m2(n: int) -> str:
    calls = "".join(
        f'<invoke name="f{i}">\n<parameter name="x">{i}</parameter>\n</invoke>\n' for i in range(n)
    )
    return "<minimax:tool_call>\n" + calls + "</minimax:tool_call>"


def _kimi_k2(n: int) -> str:
    calls = "".join(
        f'<|tool_call_begin|>functions.f{i}:{i}<|tool_call_argument_begin|>{{"x": {i}}}<|tool_call_end|>'
        for i in range(n)
    )
    return "Sure.<|tool_calls_section_begin|>" + calls + "<|tool_calls_section_end|>"


def _deepseek_v31(n: int) -> str:
    calls = "".join(
        f'<｜tool▁call▁begin｜>f{i}<｜tool▁sep｜>{{"x": {i}, "s": "}}"}}<｜tool▁call▁end｜>'
        for i in range(n)
    )
    return "<｜tool▁calls▁begin｜>" + calls + "<｜tool▁calls▁end｜>"


def _granite(n: int) -> str:
    return (
        "<|tool_call|>["
        + ", ".join(f'{{"name": "f{i}", "arguments": {{"x": {i}}}}}' for i in range(n))
        + "]"
    )


def _required(n: int) -> str:
    return "[" + ", ".join(f'{{"name": "f", "parameters": {{"x": {i}}}}}' for i in range(n)) + "]"


FORMATS = {
    "hermes": (get_tool_parser("hermes"), _hermes),
    "hermes_text": (get_tool_parser("hermes"), _hermes_then_text),
    "llama3_json": (get_tool_parser("llama3_json"), _llama3),
    "mistral": (get_tool_parser("mistral"), _mistral_array),
    "mistral_v11": (get_tool_parser("mistral"), _mistral_v11),
    "pythonic": (get_tool_parser("pythonic"), _pythonic),
    "deepseek_v3": (get_tool_parser("deepseek_v3"), _deepseek_v3),
    "qwen3_coder": (get_tool_parser("qwen3_coder"), _qwen3_coder),
    "glm45": (get_tool_parser("glm45"), _glm45),
    "minimax_m2": (get_tool_parser("minimax_m2"), _minimax_m2),
    "kimi_k2": (get_tool_parser("kimi_k2"), _kimi_k2),
    "deepseek_v31": (get_tool_parser("deepseek_v31"), _deepseek_v31),
    "granite": (get_tool_parser("granite"), _granite),
    "required": (RequiredToolCallParser, _required),
}


def counting(base: type[ToolParser]) -> type[ToolParser]:
    """``base`` counting the characters it is given to split, with predictable call ids."""

    class Counting(base):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__([])
            self.examined = 0
            self._ids = itertools.count()

        def split(self, text: str, final: bool) -> Any:
            self.examined += len(text)
            return super().split(text, final)

        def split_tail(self, text: str, final: bool, state: str) -> Any:
            self.examined += len(text)
            return super().split_tail(text, final, state)

        def make_id(self) -> str:
            return f"call_{next(self._ids)}"

    return Counting


def whole_text_splitting(base: type[ToolParser]) -> type[ToolParser]:
    """``base`` split from the start after every delta (the streamer's former behaviour)."""

    class Whole(counting(base)):  # type: ignore[misc]
        def split_tail(self, text: str, final: bool, state: str) -> Any:
            return ToolParser.split_tail(self, text, final, state)

    return Whole


def stream(parser: ToolParser, text: str, size: int = 4) -> list[tuple[str, list]]:
    streamer = parser.streamer()
    out = [streamer.feed(text[i : i + size]) for i in range(0, len(text), size)]
    return [*out, streamer.finish()]


def joined(events: list[tuple[str, list]]) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(c for c, _ in events)
    calls: dict[int, list[str]] = {}
    for _, deltas in events:
        for d in deltas:
            entry = calls.setdefault(d["index"], [d["function"].get("name", ""), ""])
            entry[1] += d["function"]["arguments"]
    return content, [(name, args) for name, args in calls.values()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_parsing_is_linear(fmt):
    """Twice the calls (twice the deltas) is twice the work; splitting the whole text after
    every delta was four times (here: ~1,000 and ~2,000 deltas)."""
    base, make = FORMATS[fmt]
    work = []
    for n in (60, 120):
        parser = counting(base)()
        stream(parser, make(n))
        work.append(parser.examined / len(make(n)))
    assert work[1] < 1.3 * work[0], work  # characters examined per character of output


@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_calls_equal_the_whole_parse(fmt):
    base, make = FORMATS[fmt]
    text = make(80)
    events = stream(counting(base)(), text)
    assert events == stream(whole_text_splitting(base)(), text)
    extracted = counting(base)().extract(text)
    content, calls = joined(events)
    assert content == (extracted.content or "")
    assert calls == [(c.name, c.arguments) for c in extracted.tool_calls]
    assert len(calls) == (2 if fmt == "hermes_text" else 80)


# Outputs that turn out not to be call lists after some calls went out, cut outputs, and
# text between calls: the stream sends what splitting the whole text every time sent.
ODD = {
    "pythonic": ["[f(a=1), g(b=2), 3]", "[f(a=1), g(b=2)", "[f(a=1), g(2)]", " [f(a=1)]  x"],
    "hermes": [
        'a <tool_call>{"name": "f", "arguments": {}}</tool_call> b <tool_call>nope</tool_call>'
        ' c <tool_call>{"name": "g", "arguments": {"x": 1}}',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n  ',
        'x <tool_call>{"name": "f", "arguments": {}}</tool_call>  some text  \n <tool_call>'
        '{"name": "g", "arguments": {}}</tool_call> end <tool_ca  ',
        'a\n\n<tool_call>nope</tool_call> b  <tool_call>{"name": "f", "arguments": {}}',
    ],
    "llama3_json": [
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}} x',
        '{"name": "f", "parameters": {}}; {"name": "g", "para',
    ],
    "mistral": [
        'hi [TOOL_CALLS][{"name": "f", "arguments": {}}, 7]',
        'hi [TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "argu',
        '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS][1]',
        '[TOOL_CALLS]f[ARGS]{"a": 1}  [TOOL_CA',
    ],
    "deepseek_v3": [
        "a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
        "<｜tool▁call▁end｜> nope<｜tool▁calls▁end｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```'
        '<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{"b',
    ],
    "minimax_m2": [
        '<minimax:tool_call>\n<invoke name="f">\n<parameter name="x">1</parameter>\n</invoke>\n'
        "nope</minimax:tool_call>",
        '<minimax:tool_call>\n<invoke name="f">\n<parameter name="x">1</parameter>\n</invoke>\n'
        '<invoke name="g">\n<parameter name="y">2</param',
        '<minimax:tool_call><invoke name="f"></invoke></minimax:tool_call> x <minimax:tool_call>'
        '<invoke name="g"><parameter name="y">2</parameter></invoke></minimax:tool_call>',
    ],
    "qwen3_coder": [
        "a <tool_call>\n<function=f>\n</function>\n</tool_call> b <tool_call>nope</tool_call> c"
    ],
    "kimi_k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|> nope<|tool_calls_section_end|>",
    ],
    "required": [
        '[{"name": "f", "parameters": {}}, {"name": "f", "parameters": {"x"',
        '[{"name": "f", "parameters": {}}, 5]',
    ],
}


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, texts in ODD.items() for t in texts])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_odd_outputs_stream_as_before(fmt, text, size):
    base = FORMATS[fmt][0]
    assert stream(counting(base)(), text, size) == stream(whole_text_splitting(base)(), text, size)
