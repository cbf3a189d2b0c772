"""A tool parser's output read back as (content, [(name, arguments)]): whole (``extract``) or
rebuilt from its stream's deltas, each delta checked against OpenAI's shape on the way."""

from __future__ import annotations

import json

from trillm.parsers.tool_parsers import get_tool_parser


def parse_calls(name: str, text: str, tools: list | None = None):
    result = get_tool_parser(name)(tools).extract(text)
    return result.content, [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def stream_calls(name: str, parts: list[str], tools: list | None = None):
    """Feed ``parts``; rebuild content and calls from the deltas, checking OpenAI's shape."""
    streamer = get_tool_parser(name)(tools).streamer()
    content, calls = "", []
    for part in [*parts, None]:
        text, deltas = streamer.feed(part) if part is not None else streamer.finish()
        content += text
        for d in deltas:
            if "id" in d:  # the header: index, id, type and name, before any argument
                assert d["index"] == len(calls) and d["type"] == "function", d
                assert d["id"] and d["function"]["arguments"] == "", d
                calls.append([d["function"]["name"], "", d["id"]])
            else:
                assert set(d) == {"index", "function"} and d["index"] < len(calls), d
                calls[d["index"]][1] += d["function"]["arguments"]
    assert len({c[2] for c in calls}) == len(calls)  # ids are unique
    return content or None, [(n, json.loads(a)) for n, a, _ in calls]


def check_every_split(name: str, text: str, expected, tools: list | None = None) -> None:
    """``text`` parses to ``expected`` (content, [(name, arguments)]) whole, streamed a
    character at a time, and streamed in two parts split at every point."""
    assert parse_calls(name, text, tools) == expected
    assert stream_calls(name, list(text), tools) == expected
    for k in range(len(text) + 1):
        assert stream_calls(name, [text[:k], text[k:]], tools) == expected, k
