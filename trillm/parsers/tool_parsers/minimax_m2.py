"""MiniMax-M2's calls (vLLM's ``minimax_m2``), as its chat template asks::

    Let me check.
    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    <invoke name="get_time">
    <parameter name="tz">CET</parameter>
    </invoke>
    </minimax:tool_call>

Several invokes a block; a value is the text between its tags (stripped), typed by the tool's
JSON schema (``xml_args.minimax_value``). A block that does not read as invokes stays
content; one cut off before its end tag is content.
"""

from __future__ import annotations

from typing import Any

from trillm.parsers.tool_parsers.base import CallPiece
from trillm.parsers.tool_parsers.json_scan import skip_ws
from trillm.parsers.tool_parsers.tagged import TaggedBlockParser
from trillm.parsers.tool_parsers.xml_args import args_call, minimax_value, properties

INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
PARAMETER, PARAMETER_END = "<parameter name=", "</parameter>"


class MiniMaxM2ToolParser(TaggedBlockParser):
    name = "minimax_m2"
    START = "<minimax:tool_call>"
    END = "</minimax:tool_call>"
    markers = (START,)

    def _block(
        self, body: str, final: bool, closed: bool, after_call: bool
    ) -> tuple[list[CallPiece], int, int] | None:
        if final and not closed:
            return None  # cut off: an invoke may be missing
        calls: list[CallPiece] = []
        pos = settled = 0
        while True:
            pos = skip_ws(body, pos)
            rest = body[pos:]
            if not rest.startswith(INVOKE):
                if rest and (closed or not INVOKE.startswith(rest)):
                    return None
                return (calls, settled, len(calls)) if calls or after_call or not closed else None
            found = self._invoke(body, pos + len(INVOKE), closed)
            if found is None:
                return None
            call, pos = found
            if call is not None:
                calls.append(call)
            if pos < 0:
                return calls, settled, len(calls) - (call is not None)
            settled = pos

    def _invoke(self, body: str, start: int, closed: bool) -> tuple[CallPiece | None, int] | None:
        """The invoke whose name starts at ``start`` and where the text goes on (-1: it is
        open, the call so far, None before its name is whole); None when malformed."""
        name_end = body.find(">", start)
        if name_end < 0:
            return None if closed else (None, -1)
        name = _unquote(body[start:name_end])
        if not name:
            return None
        schema = properties(self.tools, name)
        pairs: list[tuple[str, Any]] = []
        pos = name_end + 1
        while True:
            pos = skip_ws(body, pos)
            rest = body[pos:]
            if rest.startswith(INVOKE_END):
                return args_call(name, pairs, True), pos + len(INVOKE_END)
            if not rest.startswith(PARAMETER):
                open_tag = INVOKE_END.startswith(rest) or PARAMETER.startswith(rest)
                return None if closed or not open_tag else (_so_far(name, pairs), -1)
            key_end = body.find(">", pos + len(PARAMETER))
            end = body.find(PARAMETER_END, key_end + 1) if key_end >= 0 else -1
            if end < 0:
                return None if closed else (_so_far(name, pairs), -1)
            key = _unquote(body[pos + len(PARAMETER) : key_end])
            pairs.append((key, minimax_value(body[key_end + 1 : end].strip(), schema.get(key))))
            pos = end + len(PARAMETER_END)


def _so_far(name: str, pairs: list[tuple[str, Any]]) -> CallPiece | None:
    """An open invoke, announced once a parameter is whole: nothing to take back when the
    rest shows it is not a call."""
    return args_call(name, pairs, False) if pairs else None


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text
