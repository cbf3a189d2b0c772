"""Kimi K2's calls (vLLM's ``kimi_k2``), as its chat template asks::

    Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(without the line break). The head ``functions.NAME:INDEX`` is the call's id, which Kimi's
template gives back to the model in the next turn, so it is the id the client gets too (as
vLLM does); the name is what lies between ``functions.`` and ``:``.
"""

from __future__ import annotations

import re

from trillm.parsers.tool_parsers.sectioned import Malformed, SectionedCallParser

_HEAD = re.compile(r"\s*((?:functions\.)?([\w.\-]+?):\d+)\s*")


class KimiK2ToolParser(SectionedCallParser):
    name = "kimi_k2"
    CALLS_BEGIN = "<|tool_calls_section_begin|>"
    CALLS_END = "<|tool_calls_section_end|>"
    CALL_BEGIN = "<|tool_call_begin|>"
    ARGS_OPEN = "<|tool_call_argument_begin|>"
    ARGS_CLOSE = "<|tool_call_end|>"
    markers = (CALLS_BEGIN,)

    def _head(self, head: str) -> tuple[str, str | None]:
        match = _HEAD.fullmatch(head)
        if match is None:
            raise Malformed
        return match.group(2), match.group(1)
