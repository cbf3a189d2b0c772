"""GLM-4.5 / 4.6 / 4.7's calls (vLLM's ``glm45``), as their chat templates ask::

    Let me check.<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 writes no newline after the name.) A value is typed by the tool's JSON schema
(``xml_args.glm45_value``: a string parameter as written, others as JSON). A block that does
not read as a call stays content; a block cut off before ``</tool_call>`` is content.
"""

from __future__ import annotations

import re
from typing import Any

from trillm.parsers.tool_parsers.base import CallPiece
from trillm.parsers.tool_parsers.json_scan import skip_ws
from trillm.parsers.tool_parsers.tagged import TaggedBlockParser
from trillm.parsers.tool_parsers.xml_args import args_call, glm45_value, properties

KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
_NAME = re.compile(r"[\w.\-]+")  # a function name (OpenAI allows letters, digits, _ and -)


class Glm45ToolParser(TaggedBlockParser):
    name = "glm45"
    START = "<tool_call>"
    END = "</tool_call>"
    markers = (START,)

    def _calls(self, body: str, final: bool, closed: bool) -> list[CallPiece] | None:
        if final and not closed:
            return None  # cut off: its last argument may be missing
        cuts = [i for i in (body.find("\n"), body.find(KEY)) if i >= 0]
        cut = min(cuts) if cuts else (len(body) if closed else -1)
        if cut < 0:
            return []  # the name has not ended yet
        name = body[:cut].strip()
        if not _NAME.fullmatch(name):
            return None
        found = _pairs(body, cut, closed, properties(self.tools, name))
        if found is None:
            return None
        # NOTE: announced once an argument is whole (or the call closed): nothing to take back
        # when the rest of the block shows it is not a call.
        return [args_call(name, found, closed)] if found or closed else []


def _pairs(
    body: str, pos: int, closed: bool, schema: dict[str, Any]
) -> list[tuple[str, Any]] | None:
    """The whole key / value pairs from ``pos`` on; None when something else is there."""
    pairs: list[tuple[str, Any]] = []
    while True:
        pos = skip_ws(body, pos)
        rest = body[pos:]
        if not rest.startswith(KEY):
            return pairs if not rest or (not closed and KEY.startswith(rest)) else None
        key_end = body.find(KEY_END, pos)
        value_at = skip_ws(body, key_end + len(KEY_END)) if key_end >= 0 else len(body)
        if key_end >= 0 and not VALUE.startswith(body[value_at : value_at + len(VALUE)]):
            return None  # a key without its value
        value_end = body.find(VALUE_END, value_at)
        if value_end < 0:
            return None if closed else pairs
        key = body[pos + len(KEY) : key_end].strip()
        pairs.append((key, glm45_value(body[value_at + len(VALUE) : value_end], schema.get(key))))
        pos = value_end + len(VALUE_END)
