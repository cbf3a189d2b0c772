"""The OpenAPI 3.1 description of the server, served at GET /openapi.json.

Request schemas are generated from the attrs classes in ``protocol.py`` (types and the range
metadata the validator enforces); response schemas are written out here.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, Literal, Union

import attrs

import trillm
from trillm.entrypoints.openai import protocol, protocol_embedding, protocol_responses
from trillm.sampling_params import FLOAT32_MAX, INT64_MAX, INT64_MIN

_REQUESTS = {
    "ChatCompletionRequest": protocol.ChatCompletionRequest,
    "CompletionRequest": protocol.CompletionRequest,
    "TokenizeRequest": protocol.TokenizeRequest,
    "DetokenizeRequest": protocol.DetokenizeRequest,
    "ResponsesRequest": protocol_responses.ResponsesRequest,
    "EmbeddingRequest": protocol_embedding.EmbeddingRequest,
    "PoolingRequest": protocol_embedding.PoolingRequest,
    "ClassificationRequest": protocol_embedding.ClassificationRequest,
}
_LIMIT_KEYS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "max_chars": "maxLength"}


# ---------------------------------------------------------------- schema from attrs classes


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
    kinds = {typing.get_origin(t) for t in (typing.get_args(tp) or (tp,))}
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


# ---------------------------------------------------------------- response schemas


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_NULLABLE_STR = {"type": ["string", "null"]}
_STOP_REASON = {"type": ["integer", "string", "null"]}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _response_components() -> dict[str, Any]:
    top_logprob = _obj({"token": _STR, "logprob": _NUM, "bytes": {"type": "array", "items": _INT}})
    usage = _obj(
        {
            "prompt_tokens": _INT,
            "completion_tokens": _INT,
            "total_tokens": _INT,
            "prompt_tokens_details": _obj({"cached_tokens": _INT}),
        },
        ["prompt_tokens", "completion_tokens", "total_tokens"],
    )
    chat_logprobs = _obj(
        {
            "content": {
                "type": "array",
                "items": _obj(
                    {
                        **top_logprob["properties"],
                        "top_logprobs": {"type": "array", "items": top_logprob},
                    }
                ),
            }
        }
    )
    completion_logprobs = _obj(
        {
            "tokens": {"type": "array", "items": _STR},
            "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
            "top_logprobs": {"type": "array", "items": {"type": ["object", "null"]}},
            "text_offset": {"type": "array", "items": _INT},
        }
    )
    ids = {"type": "array", "items": _INT}
    common = {"id": _STR, "object": _STR, "created": _INT, "model": _STR}
    # Tool calls and reasoning (issue 12): a stream delta's call carries index, then id, type
    # and name once, then argument fragments.
    function = _obj({"name": _STR, "arguments": _STR})
    tool_call = _obj({"index": _INT, "id": _STR, "type": _STR, "function": function})
    parsed = {
        "tool_calls": {"type": "array", "items": tool_call},
        "reasoning_content": _NULLABLE_STR,
        "reasoning": _NULLABLE_STR,
    }
    chat_choice = _obj(
        {
            "index": _INT,
            "message": _obj({"role": _STR, "content": _NULLABLE_STR, **parsed}),
            "logprobs": {"anyOf": [_ref("ChatLogprobs"), {"type": "null"}]},
            "finish_reason": _NULLABLE_STR,
            "stop_reason": _STOP_REASON,
            "token_ids": ids,
        },
        ["index", "message", "finish_reason"],
    )
    chat_chunk_choice = _obj(
        {
            "index": _INT,
            "delta": _obj({"role": _STR, "content": _NULLABLE_STR, **parsed}),
            "logprobs": {"anyOf": [_ref("ChatLogprobs"), {"type": "null"}]},
            "finish_reason": _NULLABLE_STR,
            "stop_reason": _STOP_REASON,
            "token_ids": ids,
        },
        ["index", "delta"],
    )
    completion_choice = _obj(
        {
            "index": _INT,
            "text": _STR,
            "logprobs": {"anyOf": [_ref("CompletionLogprobs"), {"type": "null"}]},
            "finish_reason": _NULLABLE_STR,
            "stop_reason": _STOP_REASON,
            "prompt_token_ids": ids,
            "token_ids": ids,
            "prompt_logprobs": {"type": ["array", "null"]},
        },
        ["index", "text"],
    )

    def listing(item: dict[str, Any]) -> dict[str, Any]:
        return {"type": "array", "items": item}

    return {
        "Usage": usage,
        "ChatLogprobs": chat_logprobs,
        "CompletionLogprobs": completion_logprobs,
        "ChatCompletionResponse": _obj(
            {
                **common,
                "choices": listing(chat_choice),
                "usage": _ref("Usage"),
                "prompt_token_ids": ids,
                "prompt_logprobs": {"type": ["array", "null"]},
            },
            ["id", "object", "created", "model", "choices", "usage"],
        ),  # fmt: skip
        "ChatCompletionChunk": _obj(
            {
                **common,
                "choices": listing(chat_chunk_choice),
                "usage": {"anyOf": [_ref("Usage"), {"type": "null"}]},
            },
            ["id", "object", "created", "model", "choices"],
        ),  # fmt: skip
        "CompletionResponse": _obj(
            {**common, "choices": listing(completion_choice), "usage": _ref("Usage")},
            ["id", "object", "created", "model", "choices", "usage"],
        ),
        "CompletionChunk": _obj(
            {
                **common,
                "choices": listing(completion_choice),
                "usage": {"anyOf": [_ref("Usage"), {"type": "null"}]},
            },
            ["id", "object", "created", "model", "choices"],
        ),  # fmt: skip
        "ModelList": _obj(
            {
                "object": _STR,
                "data": listing(
                    _obj(
                        {
                            "id": _STR,
                            "object": _STR,
                            "created": _INT,
                            "owned_by": _STR,
                            "root": _NULLABLE_STR,
                            "max_model_len": _INT,
                        },
                        ["id", "object"],
                    )  # fmt: skip
                ),
            },
            ["object", "data"],
        ),
        "TokenizeResponse": _obj(
            {"count": _INT, "max_model_len": _INT, "tokens": ids, "token_strs": listing(_STR)},
            ["count", "max_model_len", "tokens"],
        ),  # fmt: skip
        "DetokenizeResponse": _obj({"prompt": _STR}, ["prompt"]),
        **_embedding_components(),
        **_responses_components(),
        "ServerLoad": _obj({"server_load": _INT}, ["server_load"]),
        "VersionResponse": _obj({"version": _STR}, ["version"]),
        "Error": _obj(
            {
                "error": _obj(
                    {"message": _STR, "type": _STR, "param": _NULLABLE_STR, "code": _INT},
                    ["message", "type", "code"],
                )
            },
            ["error"],
        ),
    }


def _responses_components() -> dict[str, Any]:
    """The Responses API's Response object and its stream events (serving_responses.py)."""
    usage = _obj(
        {
            "input_tokens": _INT,
            "input_tokens_details": _obj({"cached_tokens": _INT}),
            "output_tokens": _INT,
            "output_tokens_details": _obj({"reasoning_tokens": _INT}),
            "total_tokens": _INT,
        },
        ["input_tokens", "output_tokens", "total_tokens"],
    )
    part = _obj({"type": {"enum": ["output_text", "reasoning_text"]}, "text": _STR}, ["type"])
    item = _obj(
        {
            "id": _STR,
            "type": {"enum": ["message", "reasoning", "function_call"]},
            "status": _STR,
            "role": _STR,
            "content": {"type": "array", "items": part},
            "summary": {"type": "array"},
            "call_id": _STR,
            "name": _STR,
            "arguments": _STR,
        },
        ["id", "type"],
    )
    response = _obj(
        {
            "id": _STR,
            "object": {"const": "response"},
            "created_at": _INT,
            "status": {"enum": ["in_progress", "completed", "incomplete"]},
            "incomplete_details": {"type": ["object", "null"]},
            "model": _STR,
            "output": {"type": "array", "items": _ref("ResponseOutputItem")},
            "usage": {"anyOf": [_ref("ResponseUsage"), {"type": "null"}]},
            "metadata": {"type": "object", "additionalProperties": _STR},
        },
        ["id", "object", "created_at", "status", "model", "output"],
    )
    event = _obj(
        {
            "type": _STR,
            "sequence_number": _INT,
            "response": _ref("Response"),
            "item": _ref("ResponseOutputItem"),
            "part": part,
            "item_id": _STR,
            "output_index": _INT,
            "content_index": _INT,
            "delta": _STR,
            "text": _STR,
            "arguments": _STR,
        },
        ["type", "sequence_number"],
    )
    return {"ResponseUsage": usage, "ResponseOutputItem": item, "Response": response,
            "ResponseStreamEvent": event}  # fmt: skip


# ---------------------------------------------------------------- paths


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
            413: "Body too large", 500: "Engine failure", 503: "Not ready, draining or engine dead"}  # fmt: skip
    return {str(c): {"description": text[c], "content": _json("Error")} for c in codes}


def _sse_event(chunk: str) -> dict[str, Any]:
    # Before OpenAPI 3.2 the schema of text/event-stream describes one event (its fields),
    # not the stream as a string. Each event's data is a JSON chunk, an error after the stream
    # started, or the final [DONE].
    payload = {"anyOf": [_ref(chunk), _ref("Error")]}
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": payload},
    }
    return {"type": "object", "properties": {"data": data}, "required": ["data"]}


def _generate_op(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": f"A {response}, or with stream=true an SSE stream of "
                    f"`data: <{chunk}>` events ending with `data: [DONE]`.",
                    "content": {
                        **_json(response),
                        "text/event-stream": {"schema": _sse_event(chunk)},
                    },
                },
                **_errors(400, 401, 404, 413, 500, 503),
            },
        }
    }


def _responses_op() -> dict[str, Any]:
    event = {
        "type": "object",
        "properties": {
            "event": _STR,
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": _ref("ResponseStreamEvent"),
            },  # fmt: skip
        },
        "required": ["event", "data"],
    }
    return {
        "post": {
            "summary": "OpenAI Responses API (text, function tools, reasoning items)",
            "requestBody": {"required": True, "content": _json("ResponsesRequest")},
            "responses": {
                "200": {
                    "description": "A Response, or with stream=true an SSE stream of typed "
                    "events (response.created ... response.completed), each with its "
                    "sequence_number; no [DONE].",
                    "content": {**_json("Response"), "text/event-stream": {"schema": event}},
                },
                **_errors(400, 401, 404, 413, 500, 503),
            },
        }
    }


def _simple_post(summary: str, request: str, response: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {"description": "OK", "content": _json(response)},
                **_errors(400, 404, 413, 503),
            },  # fmt: skip
        }
    }


def _embedding_components() -> dict[str, Any]:
    vector = {"anyOf": [{"type": "array", "items": {"type": "number"}},
                        {"type": "string", "description": "base64 of float32 little-endian"}]}  # fmt: skip
    usage = _obj({"prompt_tokens": _INT, "total_tokens": _INT}, ["prompt_tokens", "total_tokens"])

    def listing_of(item: dict[str, Any]) -> dict[str, Any]:
        return _obj(
            {"id": _STR, "object": _STR, "created": _INT, "model": _STR,
             "data": {"type": "array", "items": item}, "usage": usage},
            ["object", "model", "data", "usage"],
        )  # fmt: skip

    return {
        "EmbeddingResponse": listing_of(
            _obj({"index": _INT, "object": _STR, "embedding": vector},
                 ["index", "object", "embedding"])  # fmt: skip
        ),
        "PoolingResponse": listing_of(
            _obj({"index": _INT, "object": _STR, "data": vector}, ["index", "object", "data"])
        ),
        "ClassificationResponse": listing_of(
            _obj({"index": _INT, "label": _STR, "probs": {"type": "array",
                  "items": {"type": "number"}}, "num_classes": _INT},
                 ["index", "label", "probs", "num_classes"])  # fmt: skip
        ),
    }


@functools.cache
def build_spec() -> dict[str, Any]:
    components = _response_components()
    for name, cls in _REQUESTS.items():
        schema_of(cls, components)
        components.setdefault(name, components.get(cls.__name__, {}))
    text = {"text/plain": {"schema": {"type": "string"}}}
    paths = {
        "/v1/chat/completions": _generate_op(
            "Chat completion",
            "ChatCompletionRequest",
            "ChatCompletionResponse",
            "ChatCompletionChunk",
        ),  # fmt: skip
        "/v1/completions": _generate_op(
            "Text completion", "CompletionRequest", "CompletionResponse", "CompletionChunk"
        ),
        "/v1/models": {
            "get": {
                "summary": "The served model(s)",
                "responses": {
                    "200": {"description": "OK", "content": _json("ModelList")},
                    **_errors(401),
                },  # fmt: skip
            }
        },
        "/tokenize": _simple_post(
            "Tokenize a prompt or a chat", "TokenizeRequest", "TokenizeResponse"
        ),  # fmt: skip
        "/detokenize": _simple_post(
            "Token ids to text", "DetokenizeRequest", "DetokenizeResponse"
        ),  # fmt: skip
        "/v1/embeddings": _simple_post(
            "Embeddings of a pooling model (--runner pooling)", "EmbeddingRequest",
            "EmbeddingResponse",
        ),  # fmt: skip
        "/pooling": _simple_post(
            "Pooled vectors of a pooling model (vLLM's /pooling)", "PoolingRequest",
            "PoolingResponse",
        ),  # fmt: skip
        "/classify": _simple_post(
            "Class probabilities of a sequence classifier (vLLM's /classify)",
            "ClassificationRequest", "ClassificationResponse",
        ),  # fmt: skip
        "/v1/responses": _responses_op(),
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "Always 404: responses are not stored ('store' must be false)",
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": _STR}
                ],  # fmt: skip
                "responses": _errors(404),
            }
        },
        "/invocations": {
            "post": {
                "summary": "SageMaker's inference route: a chat completion body (with "
                "'messages') or a completion body (with 'prompt')",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "anyOf": [_ref("ChatCompletionRequest"), _ref("CompletionRequest")]
                            }
                        }
                    },
                },  # fmt: skip
                "responses": {
                    "200": {
                        "description": "As /v1/chat/completions or /v1/completions",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "anyOf": [
                                        _ref("ChatCompletionResponse"),
                                        _ref("CompletionResponse"),
                                    ]
                                }
                            }
                        },
                    },  # fmt: skip
                    **_errors(400, 404, 413, 503),
                },
            }
        },
        "/ping": {
            op: {
                "summary": "SageMaker's health check: the same answer as /health",
                "responses": {"200": {"description": "Ready"}, **_errors(503)},
            }
            for op in ("get", "post")
        },
        "/load": {
            "get": {
                "summary": "The generation requests in flight (streams until their last byte)",
                "responses": {"200": {"description": "OK", "content": _json("ServerLoad")}},
            }
        },
        "/health": {
            "get": {
                "summary": "200 once the engine is serving; 503 while not ready or draining",
                "responses": {"200": {"description": "Ready"}, **_errors(503)},
            }
        },
        "/version": {
            "get": {
                "summary": "The trillm version",
                "responses": {"200": {"description": "OK", "content": _json("VersionResponse")}},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text exposition format)",
                "responses": {"200": {"description": "OK", "content": text}},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }  # fmt: skip
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "trillm OpenAI-compatible API", "version": trillm.__version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
