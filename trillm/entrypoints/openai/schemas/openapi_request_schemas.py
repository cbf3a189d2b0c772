"""Request schemas of the OpenAPI description, generated from the attrs classes in
``protocol.py``, ``responses.py``, ``pooling.py`` and ``anthropic.py``: their types and the
range metadata (``_f``) the validator (``structuring.py``) enforces.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

import attrs

from trillm.entrypoints.openai.schemas import anthropic, pooling, protocol, responses
from trillm.entrypoints.openai.schemas import score as score_schemas
from trillm.sampling_params import FLOAT32_MAX, INT64_MAX, INT64_MIN

_REQUESTS = {
    "ChatCompletionRequest": protocol.ChatCompletionRequest,
    "CompletionRequest": protocol.CompletionRequest,
    "TokenizeRequest": protocol.TokenizeRequest,
    "DetokenizeRequest": protocol.DetokenizeRequest,
    "ResponsesRequest": responses.ResponsesRequest,
    "EmbeddingRequest": pooling.EmbeddingRequest,
    "PoolingRequest": pooling.PoolingRequest,
    "ClassificationRequest": pooling.ClassificationRequest,
    "ScoreRequest": score_schemas.ScoreRequest,
    "RerankRequest": score_schemas.RerankRequest,
    "AnthropicMessagesRequest": anthropic.MessagesRequest,
    "AnthropicCountTokensRequest": anthropic.CountTokensRequest,
}
_LIMIT_KEYS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "max_chars": "maxLength"}


def add_request_schemas(components: dict[str, Any]) -> None:
    """Each request's schema (and those of the classes it uses) into ``components``."""
    for name, cls in _REQUESTS.items():
        schema_of(cls, components)
        components.setdefault(name, components.get(cls.__name__, {}))


def schema_of(tp: Any, components: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return {}
    if tp is type(None):
        return {"type": "null"}
    if origin is Union or origin is types.UnionType:
        return {"anyOf": [schema_of(t, components) for t in typing.get_args(tp)]}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is list:
        return {"type": "array", "items": schema_of(typing.get_args(tp)[0], components)}
    if origin is dict:
        return {
            "type": "object",
            "additionalProperties": schema_of(typing.get_args(tp)[1], components),
        }
    if attrs.has(tp):
        name = tp.__name__.lstrip("_")
        if name not in components:
            components[name] = {}  # placeholder first: recursive types terminate
            components[name] = _object_schema(tp, components)
        return {"$ref": f"#/components/schemas/{name}"}
    if tp is int:  # what the validator accepts for any integer field
        return {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
    if tp is float:
        return {"type": "number", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX}
    return {"type": {bool: "boolean", str: "string"}[tp]}


def _object_schema(cls: type[Any], components: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required = []
    for field in attrs.fields(cls):
        prop = schema_of(hints[field.name], components)
        limits = field.metadata or {}
        for key, json_key in _LIMIT_KEYS.items():
            if key in limits:
                prop = {**prop, json_key: limits[key]}
        if "max_len" in limits:
            prop = _with_max_entries(prop, hints[field.name], limits["max_len"])
        if "max_prompts" in limits:
            prop = _with_max_prompts(prop, limits["max_prompts"])
        if field.default is attrs.NOTHING:
            required.append(field.name)
        elif not isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            prop = {**prop, "default": field.default}
        props[field.name] = prop
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


def _with_max_entries(prop: dict[str, Any], tp: Any, limit: int) -> dict[str, Any]:
    """maxItems for arrays, maxProperties for objects (a field is one or the other)."""
    union = typing.get_origin(tp) in (Union, types.UnionType)
    kinds = {typing.get_origin(t) for t in (typing.get_args(tp) if union else (tp,))}
    return {**prop, ("maxProperties" if dict in kinds else "maxItems"): limit}


def _with_max_prompts(prop: dict[str, Any], limit: int) -> dict[str, Any]:
    """The prompt-count limit on the array-of-prompts branches only (not on token ids)."""
    branches = []
    for branch in prop["anyOf"]:
        items = branch.get("items", {})
        if branch.get("type") == "array" and items.get("type") != "integer":
            branch = {**branch, "maxItems": limit}
        branches.append(branch)
    return {**prop, "anyOf": branches}
