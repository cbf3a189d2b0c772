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

from trillm.parsers.tool_parsers.base import CallPiece, Resume, ToolParser, held_prefix
from trillm.parsers.tool_parsers.json_scan import json_call

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (START,)

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        return self._split(text, final, settle_text=False)[0]

    def split_tail(
        self, text: str, final: bool, state: str
    ) -> tuple[list[str | CallPiece], Resume | None]:
        # The text after a call (or after content) reads as a whole output.
        return self._split(text, final, settle_text=True)

    def _split(
        self, text: str, final: bool, settle_text: bool
    ) -> tuple[list[str | CallPiece], Resume | None]:
        """The pieces, and a Resume point after the last closed block that is a call or
        (``settle_text``) after the content that ends the text, but for what it holds back."""
        pieces: list[str | CallPiece] = []
        resume: Resume | None = None
        pos = 0
        pending = ""  # text of blocks that turned out not to be calls, joined with the next
        while True:
            i = text.find(START, pos)
            if i < 0:
                tail = text[pos:]
                if final:
                    return [*pieces, pending + tail], resume
                tail = tail[: len(tail) - held_prefix(tail, START)]
                # NOTE: content up to its last non-space character stays as it is whatever
                # follows: a piece of its own, split once (a long text after a call).
                settled = len(tail.rstrip()) if settle_text else 0
                if settled == 0:
                    return [*pieces, pending + tail], resume
                pieces += [pending + tail[:settled], tail[settled:]]
                return pieces, Resume(pos + settled, len(pieces) - 1, "text", after_call=False)
            body_start = i + len(START)
            j = text.find(END, body_start)
            if j < 0:
                call, _ = json_call(text, body_start, final)
                if call is None and final:
                    pieces.append(pending + text[pos:])  # not a call: all content
                    return pieces, resume
                pieces.append(pending + text[pos:i])
                if call is not None:
                    if final:  # cut off before the closing tag, but the object is whole
                        call.complete = True
                    pieces.append(call)
                return pieces, resume
            call, end = json_call(text[:j], body_start, True)
            if call is None:
                pending += text[pos : j + len(END)]
            else:
                pieces += [pending + text[pos:i], call]
                pending = ""
                resume = Resume(j + len(END), len(pieces), "calls")
            pos = j + len(END)
