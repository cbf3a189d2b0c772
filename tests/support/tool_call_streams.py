"""A tool parser's output read back as (content, [(name, arguments)]): whole (``extract``) or
rebuilt from its stream's deltas, each delta checked against OpenAI's shape on the way."""

from __future__ import annotations

import json

from trillm.parsers.tool_parsers import get_tool_parser


def parse_calls(name: str, text: str):
    result = get_tool_parser(name)().extract(text)
    return result.content, [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def stream_calls(name: str, parts: list[str]):
    """Feed ``parts``; rebuild content and calls from the deltas, checking OpenAI's shape."""
    streamer = get_tool_parser(name)().streamer()
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
