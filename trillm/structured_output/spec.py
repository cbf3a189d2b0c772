"""What a structured-output request asks for, checked and reduced to a hashable ``GrammarSpec``.

The checks here are the cheap, O(size) ones that run when ``StructuredOutputsParams`` is built
(so a bad request is refused before any work, in the HTTP layer or the Python API): exactly one
kind, types, sizes, nesting depth. Whether the schema / regex / grammar actually compiles is
decided by xgrammar (``compiler.py``), also before the engine sees the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trillm.config.structured_outputs import StructuredOutputsConfig

# The kinds, in vLLM's names; exactly one is set on a request.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# NOTE: a schema is walked recursively by json.dumps, deepcopy and xgrammar's converter; a
# client nesting it hundreds of levels deep would hit Python's recursion limit (a 500) or worse.
# Real schemas stay far below this (containers: a schema level is usually two: {"properties":
# {"x": ...}}).
MAX_JSON_DEPTH = 128
MAX_SPEC_CHARS = 1 << 20  # 1 MiB of schema / regex / grammar text
MAX_CHOICES = 4096


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be honoured; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """The compiled-grammar cache key: what to compile, as text, with its options."""

    kind: str  # one of KINDS
    text: str  # the schema (JSON text), regex, EBNF grammar, structural tag (JSON) or choices
    any_whitespace: bool = True


def json_depth(value: Any) -> int:
    """Nesting depth of dicts/lists, without recursion (a deep value must not blow the stack)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Any
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            return depth  # deep enough to refuse: stop walking
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _load_json(param: str, text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise StructuredOutputError(
            param, f"The {what} nests deeper than {MAX_JSON_DEPTH} levels."
        ) from None
    except ValueError as exc:
        raise StructuredOutputError(param, f"The {what} is not valid JSON: {exc}") from None


def _check_json_value(param: str, value: Any, what: str) -> Any:
    """A schema given as a dict or as JSON text -> the parsed value, after the depth check."""
    if isinstance(value, str):
        if len(value) > MAX_SPEC_CHARS:
            raise StructuredOutputError(param, f"The {what} is longer than {MAX_SPEC_CHARS} chars.")
        value = _load_json(param, value, what)
    if json_depth(value) > MAX_JSON_DEPTH:
        raise StructuredOutputError(param, f"The {what} nests deeper than {MAX_JSON_DEPTH} levels.")
    return value


def _check_text(param: str, value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise StructuredOutputError(
            param, f"The {what} must be a string, got {type(value).__name__}."
        )
    if len(value) > MAX_SPEC_CHARS:
        raise StructuredOutputError(param, f"The {what} is longer than {MAX_SPEC_CHARS} chars.")
    return value


def set_no_additional_properties(schema: Any) -> Any:
    """vLLM's ``disable_additional_properties``: every object schema that does not say
    otherwise gets ``additionalProperties: false``. Returns a copy; iterative."""
    root = json.loads(json.dumps(schema))  # depth already checked
    stack = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if (item.get("type") == "object" or "properties" in item) and (
                "additionalProperties" not in item
            ):
                item["additionalProperties"] = False
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return root


def check_params(so: Any, config: StructuredOutputsConfig | None = None) -> GrammarSpec:
    """``StructuredOutputsParams`` -> ``GrammarSpec``; ``StructuredOutputError`` if malformed.
    ``config`` (structured_outputs_config): its whitespace and additionalProperties settings
    apply to every request as if the request set them; its backend may refuse a grammar."""
    chosen = [k for k in KINDS if getattr(so, k) is not None]
    if len(chosen) != 1:
        raise StructuredOutputError(
            "structured_outputs",
            f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
            f"got {', '.join(chosen) or 'none'}.",
        )
    kind = chosen[0]
    value = getattr(so, kind)
    param = f"structured_outputs.{kind}"
    config = config or StructuredOutputsConfig()
    any_ws = not (so.disable_any_whitespace or config.disable_any_whitespace)
    if kind == "json":
        if not isinstance(value, dict | str):
            raise StructuredOutputError(param, "The JSON schema must be an object or a string.")
        schema = _check_json_value(param, value, "JSON schema")
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError(param, "The JSON schema must be a JSON object.")
        if so.disable_additional_properties or config.disable_additional_properties:
            schema = set_no_additional_properties(schema)
        return GrammarSpec("json", json.dumps(schema), any_ws)
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputError(param, "json_object must be true when given.")
        return GrammarSpec("json_object", "", any_ws)
    if kind == "choice":
        if not isinstance(value, list | tuple) or not value:
            raise StructuredOutputError(param, "choice must be a non-empty list of strings.")
        if len(value) > MAX_CHOICES:
            raise StructuredOutputError(param, f"choice allows at most {MAX_CHOICES} strings.")
        if not all(isinstance(c, str) for c in value):
            raise StructuredOutputError(param, "choice must be a list of strings.")
        if sum(len(c) for c in value) > MAX_SPEC_CHARS:
            raise StructuredOutputError(param, f"choice is longer than {MAX_SPEC_CHARS} chars.")
        return GrammarSpec("choice", json.dumps(list(value)), any_ws)
    if kind == "structural_tag":
        if isinstance(value, dict):
            tag = _check_json_value(param, value, "structural tag")
            return GrammarSpec("structural_tag", json.dumps(tag), any_ws)
        text = _check_text(param, value, "structural tag")
        _check_json_value(param, text, "structural tag")
        return GrammarSpec("structural_tag", text, any_ws)
    if kind == "grammar" and (refusal := config.grammar_refusal()) is not None:
        raise StructuredOutputError(param, refusal)
    what = {"regex": "regex", "grammar": "grammar"}[kind]
    return GrammarSpec(kind, _check_text(param, value, what), any_ws)
