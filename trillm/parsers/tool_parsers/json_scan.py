"""Scanning JSON in model output that may stop anywhere: where a JSON value ends (brackets
and strings tracked, nothing parsed before it is whole), and the call object
``{"name": ..., "arguments"|"parameters": {...}}`` as a ``CallPiece``, complete or growing.
Shared by the JSON-speaking parsers (hermes, json_lists); ``skip_ws`` by the others too.
"""

from __future__ import annotations

import json
import re

from trillm.parsers.tool_parsers.base import CallPiece

_SPECIAL = re.compile(r'["\\{}\[\]]')
_SCALAR_END = re.compile(r"[\s,}\]]")


def scan_json_value(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``s[i]``, or None when ``s`` ends
    first. Tracks brackets and strings only; whether it parses is ``json.loads``'s call."""
    if i >= len(s):
        return None
    c = s[i]
    if c not in '{["':
        m = _SCALAR_END.search(s, i)
        return m.start() if m else None
    depth = 0
    in_str = False
    k = i
    while True:
        m = _SPECIAL.search(s, k)
        if m is None:
            return None
        ch = m.group()
        k = m.end()
        if in_str:
            if ch == "\\":
                k += 1  # the escaped character
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return k
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return k


_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_HEAD = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_call(body: str, start: int, final: bool) -> tuple[CallPiece | None, int | None]:
    """The call object ``{"name": ..., "arguments"|"parameters": {...}}`` at ``body[start:]``.

    Returns ``(call, end)``: ``end`` is where the object ends, None while it is open. ``call``
    is None when this is not (or, before the end, not yet recognisably) a call."""
    end = scan_json_value(body, skip_ws(body, start))
    head = _NAME_HEAD.match(body, start)
    if end is not None:
        return _complete_json_call(body, start, end, head), end
    if final or head is None:
        return None, None
    name = json.loads(f'"{head.group(1)}"')
    args = _ARGS_HEAD.match(body, head.end())
    if args is None or not body.startswith("{", args.end()):
        return CallPiece(name), None
    value_end = scan_json_value(body, args.end())
    return CallPiece(name, body[args.end() : value_end]), None


def _complete_json_call(
    body: str, start: int, end: int, head: re.Match[str] | None
) -> CallPiece | None:
    if head is not None:
        # The usual key order: arguments as the model wrote them (what was streamed).
        args = _ARGS_HEAD.match(body, head.end())
        if args is not None and body.startswith("{", args.end()):
            value_end = scan_json_value(body, args.end())
            raw = body[args.end() : value_end] if value_end is not None else ""
            if value_end is not None and _is_json_object(raw):
                return CallPiece(json.loads(f'"{head.group(1)}"'), raw, True)
    try:
        obj = json.loads(body[start:end])
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    value = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(value, str) and _is_json_object(value):
        return CallPiece(obj["name"], value, True)  # arguments sent as a JSON string
    if not isinstance(value, dict):
        return None
    return CallPiece(obj["name"], json.dumps(value, ensure_ascii=False), True)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i
