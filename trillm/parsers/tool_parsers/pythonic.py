"""Pythonic calls (Llama 3.2 / Llama 4 and others prompted so): the whole output is a Python
list of calls with keyword arguments, optionally inside ``<|python_start|>...<|python_end|>``::

    [get_weather(city="Paris", unit="celsius"), get_time(tz="CET")]

Arguments are Python literals, given to the client as a JSON object. Any other output is
content. A streamed call is announced, with its arguments in one fragment, once its closing
parenthesis has come.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from trillm.parsers.tool_parsers.base import CallListParser, CallPiece, Resume
from trillm.parsers.tool_parsers.json_scan import skip_ws

_NAME = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_PARTIAL_NAME = re.compile(r"[A-Za-z_][\w.]*\s*$")
_SPECIAL = re.compile(r"""['"\\()\[\]{}]""")


def _close_paren(s: str, i: int) -> int | None:
    """Index after the parenthesis closing the one at ``s[i - 1]``; None if ``s`` ends first."""
    depth = 1
    quote = ""
    while True:
        m = _SPECIAL.search(s, i)
        if m is None:
            return None
        ch = m.group()
        i = m.end()
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i


def _call_arguments(src: str) -> str | None:
    """``f(a=1, b="x")`` -> ``{"a": 1, "b": "x"}``; None if it is not such a call."""
    try:
        node = ast.parse(src, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            args[kw.arg] = ast.literal_eval(kw.value)
        return json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class PythonicToolParser(CallListParser):
    name = "pythonic"
    start_only = True
    START = "<|python_start|>"
    END = "<|python_end|>"

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[list[CallPiece], Resume | None] | None:
        return self._calls(text, 0, final, after_call=True)

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        pos = skip_ws(text, 0)
        if text.startswith(self.START, pos):
            pos = skip_ws(text, pos + len(self.START))
        elif not final and self.START.startswith(text[pos:]):
            return [], None  # nothing yet, or the start of the opening tag
        if pos == len(text) and not final:
            return [], None
        if not text.startswith("[", pos):
            return [text], None
        found = self._calls(text, pos + 1, final, after_call=False)
        if found is None:
            return ([text] if final else []), None
        return list(found[0]), found[1]

    def _calls(
        self, text: str, pos: int, final: bool, after_call: bool
    ) -> tuple[list[CallPiece], Resume | None] | None:
        """The calls from ``text[pos:]`` (``after_call``: just after a call, before its
        separator) and a Resume point after the last whole one; None if not a call list."""
        calls: list[CallPiece] = []
        resume: Resume | None = None
        after: int | None = self._separator(text, pos, final) if after_call else pos
        while after is not None:
            pos = skip_ws(text, after)
            if pos == len(text):
                return None if final else (calls, resume)
            if text.startswith("]", pos):
                whole = (calls or after_call) and self._only_end(text, pos + 1, final)
                return (calls, resume) if whole else None
            m = _NAME.match(text, pos)
            if m is None:
                partial = not final and _PARTIAL_NAME.fullmatch(text, pos)
                return (calls, resume) if partial else None
            end = _close_paren(text, m.end())
            if end is None:
                # NOTE: announced only once whole: its arguments are known then, and a call
                # that does not parse (positional arguments...) was never announced.
                return None if final else (calls, resume)
            args = _call_arguments(text[pos:end])
            if args is None:
                return None
            calls.append(CallPiece(m.group(1), args, True))
            resume = Resume(end, len(calls), "calls")
            after = self._separator(text, end, final)
        return None

    def _separator(self, text: str, end: int, final: bool) -> int | None:
        """Where the next call may start after a call ending at ``end``; None if no ``,`` or
        ``]`` follows it."""
        pos = skip_ws(text, end)
        if text.startswith(",", pos):
            return pos + 1
        if not text.startswith("]", pos) and (final or pos < len(text)):
            return None
        return pos

    def _only_end(self, text: str, pos: int, final: bool) -> bool:
        rest = text[pos:].strip()
        return rest in ("", self.END) or (not final and self.END.startswith(rest))
