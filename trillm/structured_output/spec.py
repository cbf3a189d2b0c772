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
# NOTE: what a spec costs to compile grows with its size, superlinearly for some shapes, and the
# compile cannot be interrupted; these bound it before xgrammar sees the spec (measured with
# xgrammar 0.2.9, 4,096-token vocabulary, loaded 2-core host): a 1 MB regex compiled 61 s into a
# 252 MiB grammar (then refused for its size) and the process kept the memory; 30,000 "[a-z]"
# 12 s; one object of 5,000 optional string properties 10.5 s (1,000: 0.6 s). Real specs stay
# far below (a regex of a few hundred characters, schemas of hundreds of nodes).
MAX_SPEC_CHARS = 1 << 20  # 1 MiB of JSON text (a schema or structural tag given as a string)
MAX_REGEX_CHARS = 16_384  # worst measured shape ("[a-z]" repeated) at this size: ~1 s
MAX_GRAMMAR_CHARS = 32_768  # EBNF / Lark text; "[a-z]" repeated to this size: ~4 s
MAX_CHOICES = 4096
MAX_CHOICE_CHARS = 65_536  # all choices together
MAX_SCHEMA_NODES = 10_000  # JSON values in a schema / structural tag (objects, lists, scalars)
# Properties: their cost is superlinear, in one object's and in all (optional properties of
# any value, ``{}``: one object of 512 compiled 1.4 s, two 17 s, four 48 s; one of 1,000 23 s;
# 95 objects of 95, 38 s; four of 256 4.3 s, sixteen of 128 3.6 s).
MAX_SCHEMA_PROPERTIES = 256  # of one object schema
MAX_SCHEMA_TOTAL_PROPERTIES = 2_048  # of all the object schemas of one spec


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
    return json_shape(value)[0]


def json_shape(value: Any) -> tuple[int, int, int, int]:
    """(nesting depth, JSON values, most ``properties`` of one object, ``properties`` of all
    objects) of ``value``, without recursion; the walk stops once one of them passes its bound
    (``MAX_JSON_DEPTH``, ``MAX_SCHEMA_NODES``, ``MAX_SCHEMA_PROPERTIES``,
    ``MAX_SCHEMA_TOTAL_PROPERTIES``), so a huge value costs what the bounds allow."""
    deepest = widest = total = 0
    nodes = 1  # counted when their container is opened, before they are walked
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Any
        if isinstance(item, dict):
            children = item.values()
            props = item.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
                total += len(props)
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        nodes += len(children)
        if (
            depth > MAX_JSON_DEPTH
            or nodes > MAX_SCHEMA_NODES
            or widest > MAX_SCHEMA_PROPERTIES
            or total > MAX_SCHEMA_TOTAL_PROPERTIES
        ):
            break  # enough to refuse: stop walking
        stack.extend((child, depth + 1) for child in children)
    return deepest, nodes, widest, total


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
    depth, nodes, widest, total = json_shape(value)
    if depth > MAX_JSON_DEPTH:
        raise StructuredOutputError(param, f"The {what} nests deeper than {MAX_JSON_DEPTH} levels.")
    if nodes > MAX_SCHEMA_NODES:
        raise StructuredOutputError(
            param,
            f"The {what} has more than {MAX_SCHEMA_NODES} JSON values (objects, lists, strings, "
            "numbers); a larger one costs too much to compile.",
        )
    if widest > MAX_SCHEMA_PROPERTIES:
        raise StructuredOutputError(
            param,
            f"An object of the {what} has {widest} properties, more than the "
            f"{MAX_SCHEMA_PROPERTIES} one object may have (their compile cost grows faster "
            "than their count).",
        )
    if total > MAX_SCHEMA_TOTAL_PROPERTIES:
        raise StructuredOutputError(
            param,
            f"The {what}'s objects have more than {MAX_SCHEMA_TOTAL_PROPERTIES} properties in "
            "all (their compile cost grows faster than their count).",
        )
    return value


def _check_text(param: str, value: Any, what: str, limit: int = MAX_SPEC_CHARS) -> str:
    if not isinstance(value, str):
        raise StructuredOutputError(
            param, f"The {what} must be a string, got {type(value).__name__}."
        )
    if len(value) > limit:
        raise StructuredOutputError(
            param, f"The {what} has {len(value)} characters, more than the limit of {limit}."
        )
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
        if (chars := sum(len(c) for c in value)) > MAX_CHOICE_CHARS:
            raise StructuredOutputError(
                param,
                f"choice has {chars} characters in all, more than the limit of {MAX_CHOICE_CHARS}.",
            )
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
    if kind == "regex":
        return GrammarSpec(kind, _check_text(param, value, "regex", MAX_REGEX_CHARS), any_ws)
    return GrammarSpec(kind, _check_text(param, value, "grammar", MAX_GRAMMAR_CHARS), any_ws)
