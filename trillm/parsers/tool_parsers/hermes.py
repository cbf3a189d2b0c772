"""Hermes-style calls, as Qwen2.5 / Qwen3 (and Hermes 2/3) write them::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Text outside the tags is content. A block that is not a call object stays content, tags and
all (the model wrote something else); an unclosed block at the end (cut by max_tokens) is a
call when its object is complete.
"""

from __future__ import annotations

from trillm.parsers.tool_parsers.base import CallPiece, ToolParser, held_prefix, json_call

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (START,)

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        pieces: list[str | CallPiece] = []
        pos = 0
        pending = ""  # text of blocks that turned out not to be calls, joined with the next
        while True:
            i = text.find(START, pos)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - held_prefix(tail, START)]
                pieces.append(pending + tail)
                return pieces
            body_start = i + len(START)
            j = text.find(END, body_start)
            if j < 0:
                call, _ = json_call(text, body_start, final)
                if call is None and final:
                    pieces.append(pending + text[pos:])  # not a call: all content
                    return pieces
                pieces.append(pending + text[pos:i])
                if call is not None:
                    if final:  # cut off before the closing tag, but the object is whole
                        call.complete = True
                    pieces.append(call)
                return pieces
            call, end = json_call(text[:j], body_start, True)
            if call is None:
                pending += text[pos : j + len(END)]
            else:
                pieces += [pending + text[pos:i], call]
                pending = ""
            pos = j + len(END)
