"""Qwen3-Coder's calls (vLLM's ``qwen3_coder``, also ``qwen3_xml``: the same format), as its
chat template asks (Qwen3-Coder, Qwen3.5 and Qwen3-Next write them too)::

    Let me check.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

One function a block; a value is the text between its tags (less one newline each side),
typed by the tool's JSON schema (``xml_args.qwen3_value``). A block that does not read as a
function stays content; a block cut off before ``</function>`` (max_tokens) is content.
"""

from __future__ import annotations

from typing import Any

from trillm.parsers.tool_parsers.base import CallPiece
from trillm.parsers.tool_parsers.json_scan import skip_ws
from trillm.parsers.tool_parsers.tagged import TaggedBlockParser
from trillm.parsers.tool_parsers.xml_args import args_call, properties, qwen3_value

FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


class Qwen3CoderToolParser(TaggedBlockParser):
    name = "qwen3_coder"
    START = "<tool_call>"
    END = "</tool_call>"
    markers = (START,)

    def _calls(self, body: str, final: bool, closed: bool) -> list[CallPiece] | None:
        whole = final or closed
        pos = skip_ws(body, 0)
        if not body.startswith(FUNCTION, pos):
            return None if whole or not FUNCTION.startswith(body[pos:]) else []
        name_end = body.find(">", pos + len(FUNCTION))
        if name_end < 0:
            return None if whole else []
        name = body[pos + len(FUNCTION) : name_end].strip()
        if not name or "\n" in name:
            return None
        found = self._parameters(body, name_end + 1, whole, properties(self.tools, name))
        if found is None:
            return None
        pairs, ended = found
        if whole and not ended:
            return None  # cut off inside the function
        # NOTE: announced once a parameter is whole (or the function ended): nothing to take
        # back when the rest of the block shows it is not a call.
        return [args_call(name, pairs, ended)] if pairs or ended else []

    @staticmethod
    def _parameters(
        body: str, pos: int, whole: bool, schema: dict[str, Any]
    ) -> tuple[list[tuple[str, Any]], bool] | None:
        """The whole parameters from ``pos`` on, and whether ``</function>`` came; None when
        something else is there."""
        pairs: list[tuple[str, Any]] = []
        while True:
            pos = skip_ws(body, pos)
            rest = body[pos:]
            if rest.startswith(FUNCTION_END):
                return pairs, True
            if not rest.startswith(PARAMETER):
                partial = not whole and (
                    FUNCTION_END.startswith(rest) or PARAMETER.startswith(rest)
                )
                return (pairs, False) if partial else None
            found = _parameter(body, pos + len(PARAMETER), whole)
            if found is None:
                return pairs, False
            key, raw, pos = found
            pairs.append((key, qwen3_value(raw, schema.get(key))))


def _parameter(body: str, start: int, whole: bool) -> tuple[str, str, int] | None:
    """(name, value text, where the text goes on) of the parameter whose name starts at
    ``start``; None while it is open. A value without its end tag ends (at the end of the
    block) where the next parameter or the function's end begins, as vLLM reads it."""
    name_end = body.find(">", start)
    if name_end < 0:
        return None
    value_start = name_end + 1
    end = body.find(PARAMETER_END, value_start)
    after = end + len(PARAMETER_END)
    if end < 0:
        if not whole:
            return None
        ends = [i for i in (body.find(t, value_start) for t in (PARAMETER, FUNCTION_END)) if i >= 0]
        if not ends:
            return None
        end = after = min(ends)
    raw = body[value_start:end]
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    return body[start:name_end].strip(), raw, after
