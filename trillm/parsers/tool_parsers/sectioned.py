"""Formats whose calls sit in one section after the content, each call a head (its name) and
JSON arguments between tags (deepseek_v31, kimi_k2)::

    content<CALLS_BEGIN><CALL_BEGIN>head<ARGS_OPEN>{...}<ARGS_CLOSE><CALL_BEGIN>...<CALLS_END>

A section that does not read as calls (a call without its head, tags or arguments, arguments
that are not a JSON object) leaves the whole output content; a call cut off by max_tokens is
content too. The arguments end where their JSON object does (a tag inside one of its strings
is text); while streaming they are the JSON text as written, and a stream is split from the
end of its last whole call on (linear in its length).
"""

from __future__ import annotations

import json
from typing import ClassVar

from trillm.parsers.tool_parsers.base import CallListParser, CallPiece, Resume, held_prefix
from trillm.parsers.tool_parsers.json_scan import scan_json_value, skip_ws


class Malformed(Exception):
    """The section does not read as calls: the output is content."""


class SectionedCallParser(CallListParser):
    CALLS_BEGIN: ClassVar[str] = ""
    CALLS_END: ClassVar[str] = ""
    CALL_BEGIN: ClassVar[str] = ""
    ARGS_OPEN: ClassVar[str] = ""
    ARGS_CLOSE: ClassVar[str] = ""

    def _head(self, head: str) -> tuple[str, str | None]:
        """(name, the model's call id or None) of a call's head; raises Malformed."""
        raise NotImplementedError

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[list[str | CallPiece], Resume | None] | None:
        try:  # the text after a whole call, inside the section
            return self._calls(text, 0, final, 0)
        except Malformed:
            return None

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        start = text.find(self.CALLS_BEGIN)
        if start < 0:
            held = 0 if final else held_prefix(text, self.CALLS_BEGIN)
            return [text[: len(text) - held]], None
        try:
            calls, resume = self._calls(text, start + len(self.CALLS_BEGIN), final, 1)
        except Malformed:
            return [text], None
        return [text[:start], *calls], resume

    def _calls(
        self, text: str, pos: int, final: bool, before: int
    ) -> tuple[list[str | CallPiece], Resume | None]:
        """The calls from ``pos`` on (and any text after the section), and a Resume point
        after the last whole one (``before``: the pieces that precede them)."""
        pieces: list[str | CallPiece] = []
        resume = None
        while True:
            pos = skip_ws(text, pos)
            rest = text[pos:]
            if rest.startswith(self.CALLS_END):
                return [*pieces, text[pos + len(self.CALLS_END) :]], resume
            if not rest.startswith(self.CALL_BEGIN):
                grows = self.CALL_BEGIN.startswith(rest) or self.CALLS_END.startswith(rest)
                if final or not grows:
                    raise Malformed
                return pieces, resume
            call, pos = self._call(text, pos + len(self.CALL_BEGIN), final)
            if call is not None:
                pieces.append(call)
            if pos < 0:  # the text ends inside this call
                return pieces, resume
            resume = Resume(pos, before + len(pieces), "calls")

    def _call(self, text: str, pos: int, final: bool) -> tuple[CallPiece | None, int]:
        """The call whose head starts at ``pos`` and where the text goes on after it (-1: the
        text ends inside it, the call so far or None before its head is whole)."""
        open_at = text.find(self.ARGS_OPEN, pos)
        if open_at < 0:
            head = text[pos:]
            if final or any(t in head for t in (self.CALL_BEGIN, self.ARGS_CLOSE)):
                raise Malformed
            return None, -1
        name, call_id = self._head(text[pos:open_at])
        args_start = skip_ws(text, open_at + len(self.ARGS_OPEN))
        first = text[args_start : args_start + 1]
        if first not in ("", "{"):
            raise Malformed  # not an object: known before the call is announced
        end = scan_json_value(text, args_start) if first else None
        if end is None:
            if final:  # cut off (max_tokens): not a call
                raise Malformed
            # Announced once its arguments show an object; the JSON so far is a prefix.
            return (CallPiece(name, text[args_start:], call_id=call_id) if first else None), -1
        arguments = text[args_start:end]
        after = skip_ws(text, end)
        if not text.startswith(self.ARGS_CLOSE, after):
            if final or not self.ARGS_CLOSE.startswith(text[after:]):
                raise Malformed
            return CallPiece(name, arguments, call_id=call_id), -1
        try:
            is_object = isinstance(json.loads(arguments), dict)
        except ValueError:
            is_object = False
        if not is_object:
            raise Malformed
        return CallPiece(name, arguments, True, call_id), after + len(self.ARGS_CLOSE)
