"""DeepSeek-V3 / R1 calls (vLLM's ``deepseek_v3`` parser), as their chat template asks::

    Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {"tz": "CET"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the calls' block is content (after it too, where a model writes any). A block
that does not read as calls (a call without its name, fences or end tag, arguments that are not
a JSON object) leaves the whole output content, as for the other parsers; while streaming, a
call's arguments are the JSON text as written, the closing fence held back until it is whole,
and a stream is split from the end of its last whole call on (linear in its length).
"""

from __future__ import annotations

import json

from trillm.parsers.tool_parsers.base import CallListParser, CallPiece, Resume, held_prefix
from trillm.parsers.tool_parsers.json_scan import skip_ws

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
ARGS_OPEN = "\n```json\n"
ARGS_CLOSE = "\n```<｜tool▁call▁end｜>"


class _Malformed(Exception):
    """The calls' block does not read as calls: the output is content."""


class DeepSeekV3ToolParser(CallListParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN,)

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[list[str | CallPiece], Resume | None] | None:
        try:  # the text after a whole call, inside the calls' block
            return self._calls(text, 0, final, 0)
        except _Malformed:
            return None

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        """The pieces, and a Resume point after the last whole call."""
        start = text.find(CALLS_BEGIN)
        if start < 0:
            return [text if final else text[: len(text) - held_prefix(text, CALLS_BEGIN)]], None
        try:
            calls, resume = self._calls(text, start + len(CALLS_BEGIN), final, 1)
        except _Malformed:
            return [text], None
        return [text[:start], *calls], resume

    def _calls(
        self, text: str, pos: int, final: bool, before: int
    ) -> tuple[list[str | CallPiece], Resume | None]:
        """The calls from ``pos`` on (and any text after the block), and a Resume point after
        the last whole one (``before``: the pieces that precede them); raises _Malformed."""
        pieces: list[str | CallPiece] = []
        resume = None
        while True:
            pos = skip_ws(text, pos)
            rest = text[pos:]
            if rest.startswith(CALLS_END):
                return [*pieces, text[pos + len(CALLS_END) :]], resume
            if not rest.startswith(CALL_BEGIN):
                if final or not (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
                    raise _Malformed
                return pieces, resume
            call, pos = self._call(text, pos + len(CALL_BEGIN), final)
            if call is not None:
                pieces.append(call)
            if pos < 0:  # the text ends inside this call
                return pieces, resume
            resume = Resume(pos, before + len(pieces), "calls")

    @staticmethod
    def _call(text: str, pos: int, final: bool) -> tuple[CallPiece | None, int]:
        """The call whose type starts at ``pos`` and where the text goes on after it (-1: the
        text ends inside it, the call so far or None before its name is whole)."""
        sep = text.find(SEP, pos)
        name_end = -1 if sep < 0 else text.find(ARGS_OPEN, sep + len(SEP))
        if name_end < 0:
            line_end = -1 if sep < 0 else text.find("\n", sep + len(SEP))
            if final or (line_end >= 0 and not ARGS_OPEN.startswith(text[line_end:])):
                raise _Malformed  # the name line ended without its fence
            return None, -1
        name = text[sep + len(SEP) : name_end]
        if not name or SEP in name or "\n" in name:
            raise _Malformed
        args_start = name_end + len(ARGS_OPEN)
        first = text[skip_ws(text, args_start) : skip_ws(text, args_start) + 1]
        if first not in ("", "{"):
            raise _Malformed  # not an object: known before the call is announced
        close = text.find(ARGS_CLOSE, args_start)
        if close < 0 and not first and not final:
            return None, -1  # announced once its arguments show an object
        if close < 0:
            if final:  # cut off (max_tokens): not a call
                raise _Malformed
            partial = text[args_start:]
            return CallPiece(name, partial[: len(partial) - held_prefix(partial, ARGS_CLOSE)]), -1
        arguments = text[args_start:close]
        try:
            is_object = isinstance(json.loads(arguments), dict)
        except ValueError:
            is_object = False
        if not is_object:
            raise _Malformed
        return CallPiece(name, arguments, complete=True), close + len(ARGS_CLOSE)
