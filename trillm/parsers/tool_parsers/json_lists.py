"""Formats whose whole output (or its tail) is a list of JSON call objects:

- ``llama3_json`` (Llama 3.1 / 3.2 with JSON tool calls): the output is one or more
  ``{"name": ..., "parameters": {...}}`` objects, separated by ``;``, optionally after
  ``<|python_tag|>``; anything else is content.
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of
  ``{"name": ..., "arguments": {...}}`` (tokenizer v3-v7), or ``[TOOL_CALLS]name[ARGS]{...}``
  repeated (v11 and later). These markers are special tokens: the server keeps special
  tokens in the text for this parser, and text after the calls (``</s>``) is dropped.
"""

from __future__ import annotations

import json

from trillm.parsers.tool_parsers.base import (
    CallPiece,
    ToolParser,
    held_prefix,
    json_call,
    mistral_id,
    scan_json_value,
    skip_ws,
)


def call_sequence(
    text: str, pos: int, final: bool, sep: str, close: str | None
) -> list[CallPiece] | None:
    """Call objects from ``text[pos:]`` separated by ``sep`` (and ended by ``close``, when
    given; what follows it is ignored). None when the text is not such a list; before the
    end, the calls recognised so far."""
    calls: list[CallPiece] = []
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return calls if not final or (close is None and calls) else None
        if close is not None and text.startswith(close, pos):
            return calls or None
        call, end = json_call(text, pos, final)
        if call is None:
            return None if final or end is not None else calls
        calls.append(call)
        if end is None:
            return calls
        pos = skip_ws(text, end)
        if pos >= len(text):
            return calls if close is None or not final else None
        if text.startswith(sep, pos):
            pos += len(sep)
        elif close is not None and text.startswith(close, pos):
            return calls
        else:
            return None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_only = True
    TAG = "<|python_tag|>"

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        start = skip_ws(text, 0)
        if text.startswith(self.TAG, start):
            start += len(self.TAG)
        elif not final and (start == len(text) or self.TAG.startswith(text[start:])):
            return []  # cannot tell yet
        if not text.startswith("{", skip_ws(text, start)):
            if not final and skip_ws(text, start) == len(text):
                return []
            return [text]
        calls = call_sequence(text, start, final, ";", None)
        if calls is None:
            return [text] if final else []
        return list(calls)


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def make_id(self) -> str:
        return mistral_id()

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        i = text.find(self.TAG)
        if i < 0:
            return [text if final else text[: len(text) - held_prefix(text, self.TAG)]]
        rest = i + len(self.TAG)
        first = skip_ws(text, rest)
        if first == len(text) and not final:
            return [text[:i]]
        if text.startswith("[", first):
            calls = call_sequence(text, first + 1, final, ",", "]")
        else:
            calls = self._v11_calls(text, rest, final)
        if calls is None:
            return [text] if final else [text[:i]]
        return [text[:i], *calls]

    def _v11_calls(self, text: str, pos: int, final: bool) -> list[CallPiece] | None:
        calls: list[CallPiece] = []
        while True:
            a = text.find(self.ARGS, pos)
            if a < 0:
                return None if final else calls
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
                return calls
            try:
                if not isinstance(json.loads(text[start:end]), dict):
                    return None
            except json.JSONDecodeError:
                return None
            calls.append(CallPiece(name, text[start:end], True))
            nxt = skip_ws(text, end)
            if not text.startswith(self.TAG, nxt):
                return calls  # what follows the calls (an end-of-text token) is not content
            pos = nxt + len(self.TAG)
