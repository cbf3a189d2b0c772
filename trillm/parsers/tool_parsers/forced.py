"""``tool_choice`` "required" and named functions: the output is constrained by a JSON schema
(structured outputs), so it is a valid call by construction; these parse it.

- named: the output is the function's arguments object;
- required: the output is ``[{"name": ..., "parameters": {...}}, ...]``, each item one of the
  request's tools with its parameters schema (one item when ``parallel_tool_calls`` is false).
"""

from __future__ import annotations

from typing import Any

from trillm.parsers.tool_parsers.base import CallListParser, CallPiece, Resume, ToolParser
from trillm.parsers.tool_parsers.json_lists import call_sequence, resumable_call_sequence
from trillm.parsers.tool_parsers.json_scan import skip_ws

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _ANY_OBJECT


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool["function"]["name"] == name:
            return _parameters(tool)
    raise KeyError(name)


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class NamedToolCallParser(ToolParser):
    name = "<named>"

    def __init__(self, tools: list[dict[str, Any]] | None, function_name: str) -> None:
        super().__init__(tools)
        self.function_name = function_name

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        return [CallPiece(self.function_name, text.strip(), final)]


class RequiredToolCallParser(CallListParser):
    name = "<required>"

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[list[CallPiece], Resume | None] | None:
        return resumable_call_sequence(text, 0, final, ",", "]", after_call=True)

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        start = skip_ws(text, 0)
        if start == len(text) and not final:
            return [], None
        if not text.startswith("[", start):
            return ([text] if final else []), None
        found = resumable_call_sequence(text, start + 1, final, ",", "]", after_call=False)
        if found is not None:
            return list(found[0]), found[1]
        if not final:
            return [], None
        # NOTE: the grammar allows only calls, so an unclosed array was cut by max_tokens:
        # its whole items are valid calls (and were streamed as such).
        calls = call_sequence(text, start + 1, False, ",", "]") or []
        return [c for c in calls if c.complete], None
