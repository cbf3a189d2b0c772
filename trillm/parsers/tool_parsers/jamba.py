"""Jamba 1.5 / 1.6's calls (vLLM's ``jamba``), as its chat template asks: a JSON array of
call objects in ``<tool_calls>`` tags after the content::

    Let me check.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}},
    {"name": "get_time", "arguments": {"tz": "CET"}}]</tool_calls>

A block that is not such an array stays content.
"""

from __future__ import annotations

from trillm.parsers.tool_parsers.base import CallPiece
from trillm.parsers.tool_parsers.json_lists import call_sequence
from trillm.parsers.tool_parsers.json_scan import skip_ws
from trillm.parsers.tool_parsers.tagged import TaggedBlockParser


class JambaToolParser(TaggedBlockParser):
    name = "jamba"
    START = "<tool_calls>"
    END = "</tool_calls>"
    markers = (START,)

    def _calls(self, body: str, final: bool, closed: bool) -> list[CallPiece] | None:
        start = skip_ws(body, 0)
        if start == len(body) and not (final or closed):
            return []
        if not body.startswith("[", start):
            return None
        calls = call_sequence(body, start + 1, final or closed, ",", "]")
        if calls is not None and (final or closed) and not body.rstrip().endswith("]"):
            return None  # the array did not close: cut off
        return calls
