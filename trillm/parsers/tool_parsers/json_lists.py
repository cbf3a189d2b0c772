"""Formats whose whole output (or its tail) is a list of JSON call objects:

- ``llama3_json`` (Llama 3.1 / 3.2 with JSON tool calls): the output is one or more
  ``{"name": ..., "parameters": {...}}`` objects, separated by ``;``, optionally after
  ``<|python_tag|>``; anything else is content.
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of
  ``{"name": ..., "arguments": {...}}`` (tokenizer v3-v7), or ``[TOOL_CALLS]name[ARGS]{...}``
  repeated (v11 and later). These markers are special tokens: the server keeps special
  tokens in the text for this parser, and text after the calls (``</s>``) is dropped.
- ``granite`` (Granite 3.x): the output is a JSON array of calls, optionally after
  ``<|tool_call|>`` (3.0) or ``<tool_call>`` (3.1); anything else is content.
- ``phi4_mini_json`` (Phi-4-mini): content, then ``functools`` and a JSON array of calls
  (text after the array is dropped, as for mistral).
"""

from __future__ import annotations

import json
from dataclasses import replace

from trillm.parsers.tool_parsers.base import (
    CallListParser,
    CallPiece,
    Resume,
    held_prefix,
    mistral_id,
)
from trillm.parsers.tool_parsers.json_scan import json_call, scan_json_value, skip_ws


def call_sequence(
    text: str, pos: int, final: bool, sep: str, close: str | None
) -> list[CallPiece] | None:
    """Call objects from ``text[pos:]`` separated by ``sep`` (and ended by ``close``, when
    given; what follows it is ignored). None when the text is not such a list; before the
    end, the calls recognised so far."""
    found = resumable_call_sequence(text, pos, final, sep, close, after_call=False)
    return None if found is None else found[0]


def resumable_call_sequence(
    text: str, pos: int, final: bool, sep: str, close: str | None, after_call: bool
) -> tuple[list[CallPiece], Resume | None] | None:
    """``call_sequence`` from ``pos`` (``after_call``: just after a call, before its
    separator), with a Resume point (state "calls") after the last whole call."""
    calls: list[CallPiece] = []
    resume: Resume | None = None
    expect_sep = after_call
    while True:
        if expect_sep:
            pos = skip_ws(text, pos)
            if pos >= len(text):
                return (calls, resume) if close is None or not final else None
            if text.startswith(sep, pos):
                pos += len(sep)
            elif close is not None and text.startswith(close, pos):
                return calls, resume
            else:
                return None
        pos = skip_ws(text, pos)
        seen = bool(calls) or after_call
        if pos >= len(text):
            return (calls, resume) if not final or (close is None and seen) else None
        if close is not None and text.startswith(close, pos):
            return (calls, resume) if seen else None
        call, end = json_call(text, pos, final)
        if call is None:
            return None if final or end is not None else (calls, resume)
        calls.append(call)
        if end is None:
            return calls, resume
        resume = Resume(end, len(calls), "calls")
        pos, expect_sep = end, True


class Llama3JsonToolParser(CallListParser):
    name = "llama3_json"
    start_only = True
    TAG = "<|python_tag|>"

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[list[CallPiece], Resume | None] | None:
        return resumable_call_sequence(text, 0, final, ";", None, after_call=True)

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        start = skip_ws(text, 0)
        if text.startswith(self.TAG, start):
            start += len(self.TAG)
        elif not final and (start == len(text) or self.TAG.startswith(text[start:])):
            return [], None  # cannot tell yet
        if not text.startswith("{", skip_ws(text, start)):
            if not final and skip_ws(text, start) == len(text):
                return [], None
            return [text], None
        found = resumable_call_sequence(text, start, final, ";", None, after_call=False)
        if found is None:
            return ([text] if final else []), None
        return list(found[0]), found[1]


class MistralToolParser(CallListParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def make_id(self) -> str:
        return mistral_id()

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[list[CallPiece], Resume | None] | None:
        return self._calls(text, 0, final, state, after_call=True)

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        i = text.find(self.TAG)
        if i < 0:
            return [text if final else text[: len(text) - held_prefix(text, self.TAG)]], None
        rest = i + len(self.TAG)
        first = skip_ws(text, rest)
        if first == len(text) and not final:
            return [text[:i]], None
        if text.startswith("[", first):
            found = self._calls(text, first + 1, final, "array", after_call=False)
        else:
            found = self._calls(text, rest, final, "v11", after_call=False)
        if found is None:
            return ([text] if final else [text[:i]]), None
        calls, resume = found
        # The content before the calls is a piece before the Resume point too.
        return [text[:i], *calls], None if resume is None else replace(
            resume, pieces=resume.pieces + 1
        )

    def _calls(
        self, text: str, pos: int, final: bool, form: str, after_call: bool
    ) -> tuple[list[CallPiece], Resume | None] | None:
        """The calls of the array ("array") or ``[TOOL_CALLS]name[ARGS]{...}`` ("v11") form."""
        if form == "v11":
            return self._v11_calls(text, pos, final, after_call)
        found = resumable_call_sequence(text, pos, final, ",", "]", after_call)
        if found is None or found[1] is None:
            return found
        return found[0], replace(found[1], state="array")

    def _v11_calls(
        self, text: str, pos: int, final: bool, after_call: bool
    ) -> tuple[list[CallPiece], Resume | None] | None:
        calls: list[CallPiece] = []
        resume: Resume | None = None
        after: int | None = self._next_tag(text, pos) if after_call else pos
        while after is not None:
            pos = after
            a = text.find(self.ARGS, pos)
            if a < 0:
                return None if final else (calls, resume)
            name = text[pos:a].strip()
            if not name or any(c in name for c in " \n[]{}"):
                return None
            start = skip_ws(text, a + len(self.ARGS))
            end = scan_json_value(text, start)
            if end is None:
                if final:
                    return None
                raw = text[start:] if text.startswith("{", start) else ""
                calls.append(CallPiece(name, raw))
                return calls, resume
            try:
                if not isinstance(json.loads(text[start:end]), dict):
                    return None
            except json.JSONDecodeError:
                return None
            calls.append(CallPiece(name, text[start:end], True))
            resume = Resume(end, len(calls), "v11")
            after = self._next_tag(text, end)
        return calls, resume

    def _next_tag(self, text: str, end: int) -> int | None:
        """Where the next call starts after one ending at ``end``; None when no
        ``[TOOL_CALLS]`` follows (what follows the calls, an end-of-text token, is not
        content)."""
        nxt = skip_ws(text, end)
        return nxt + len(self.TAG) if text.startswith(self.TAG, nxt) else None


class GraniteToolParser(CallListParser):
    name = "granite"
    start_only = True
    TAGS = ("<|tool_call|>", "<tool_call>")

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[list[CallPiece], Resume | None] | None:
        return resumable_call_sequence(text, 0, final, ",", "]", after_call=True)

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        start = skip_ws(text, 0)
        for tag in self.TAGS:  # in this order, as vLLM strips them
            if text.startswith(tag, start):
                start = skip_ws(text, start + len(tag))
        rest = text[start:]
        if not final and (not rest or any(t.startswith(rest) for t in self.TAGS)):
            return [], None  # cannot tell yet
        if not rest.startswith("["):
            return [text], None
        found = resumable_call_sequence(text, start + 1, final, ",", "]", after_call=False)
        if found is None:
            return [text], None
        return list(found[0]), found[1]


class Phi4MiniJsonToolParser(CallListParser):
    name = "phi4_mini_json"
    TAG = "functools["
    markers = (TAG,)

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[list[CallPiece], Resume | None] | None:
        return resumable_call_sequence(text, 0, final, ",", "]", after_call=True)

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        i = text.find(self.TAG)
        if i < 0:
            return [text if final else text[: len(text) - held_prefix(text, self.TAG)]], None
        found = resumable_call_sequence(text, i + len(self.TAG), final, ",", "]", False)
        if found is None:
            return [text], None
        calls, resume = found
        # The content before the calls is a piece before the Resume point too.
        return [text[:i], *calls], None if resume is None else replace(
            resume, pieces=resume.pieces + 1
        )
