"""Arguments written as tagged name / value pairs (qwen3_coder, glm45, minimax_m2): each value
is text, given its JSON type by the tool's JSON schema as vLLM's parsers give it, and the
arguments object is built pair by pair, so what a stream sent is a prefix of the final JSON:
``{`` and the whole pairs so far, ``}`` once the call closes."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Sequence
from typing import Any

from trillm.parsers.tool_parsers.base import CallPiece

# How a parameter's text becomes its value, given the parameter's schema (None: unknown).
Converter = Callable[[str, Any], Any]


def properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The ``properties`` of the parameters' schema of the request's tool ``name``."""
    for tool in tools:
        function = tool.get("function", tool)
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def args_call(name: str, pairs: Sequence[tuple[str, Any]], closed: bool) -> CallPiece:
    """The call ``name`` with the whole ``pairs`` so far (``closed``: all of them)."""
    body = ", ".join(
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
        for k, v in pairs
    )
    return CallPiece(name, "{" + body + ("}" if closed else ""), complete=closed)


def _schema_type(schema: Any) -> tuple[str, bool]:
    """(the first non-null type, whether null is allowed) of a parameter's schema."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        kind = str(schema["type"]).strip().lower()
        return kind, kind == "null"
    kinds = [str(o["type"]).strip().lower() for o in schema.get("anyOf", ()) if "type" in o]
    others = [k for k in kinds if k != "null"]
    return (others[0] if others else "string"), "null" in kinds


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def qwen3_value(raw: str, schema: Any) -> Any:
    """Qwen3-Coder's rules: a parameter the schema does not name is a string; strings stay
    as written; integers, numbers and booleans by their text; objects and arrays as JSON
    (else a Python literal); null / None for a nullable or non-string parameter."""
    if schema is None:
        return raw
    kind, nullable = _schema_type(schema)
    if nullable and raw.lower() in ("null", "none"):
        return None
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return raw
    if raw.lower() in ("null", "none"):
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        return _number(raw, int)
    if kind.startswith(("num", "float")):
        return _number(raw, float)
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(raw)
        except ValueError:
            pass
    return _literal(raw)


def _number(raw: str, kind: type) -> Any:
    try:
        value = kind(raw)
    except (ValueError, OverflowError):
        return raw  # not a number after all: the text
    return int(value) if kind is float and value.is_integer() else value


def glm45_value(raw: str, schema: Any) -> Any:
    """GLM-4.5's rules: a string parameter stays as written; others are JSON, else a Python
    literal, else the text."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return raw
    text = raw.strip()
    try:
        return json.loads(text)
    except ValueError:
        return _literal(text)


def _minimax_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return {"string"}
    kinds: set[str] = set()
    declared = schema.get("type")
    kinds.update([declared] if isinstance(declared, str) else declared or [])
    for value in schema.get("enum") or ():
        kinds.add(_json_kind(value))
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or ():
            kinds |= _minimax_types(option)
    return {str(k).lower() for k in kinds} or {"string"}


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, kind):
            return name
    return "array" if isinstance(value, list) else "object"


def minimax_value(raw: str, schema: Any) -> Any:
    """MiniMax-M2's rules: null / none / nil is null; else the schema's types are tried
    integer, number, boolean, object / array, string in that order; else JSON, else text."""
    if raw.lower() in ("null", "none", "nil"):
        return None
    kinds = _minimax_types(schema)
    for kind in _MINIMAX_ORDER:
        if kind in kinds:
            value = raw if kind in ("string", "str", "text") else _minimax_as(raw, kind)
            if value is not _NO:
                return value
    try:
        return json.loads(raw)
    except ValueError:
        return raw


_MINIMAX_ORDER: tuple[str, ...] = ("integer", "int", "number", "float", "boolean", "bool")
_MINIMAX_ORDER += ("object", "array", "string", "str", "text")
_NO = object()  # a value that did not convert


def _minimax_as(raw: str, kind: str) -> Any:
    if kind in ("integer", "int"):
        try:
            return int(raw)
        except ValueError:
            return _NO
    if kind in ("number", "float"):
        value = _number(raw, float)
        return _NO if isinstance(value, str) else value
    if kind in ("boolean", "bool"):
        return _BOOLEAN_WORDS.get(raw.lower().strip(), _NO)
    try:
        return json.loads(raw)
    except ValueError:
        return _NO


_BOOLEAN_WORDS = {"true": True, "1": True, "yes": True, "on": True}
_BOOLEAN_WORDS |= {"false": False, "0": False, "no": False, "off": False}
