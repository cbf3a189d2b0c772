"""Response schemas of the OpenAPI description, written out: chat and text completions (and
their stream chunks), models, tokenize, embeddings / pooling / classify, the Responses API,
load, version and the error body.
"""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_NULLABLE_STR = {"type": ["string", "null"]}
_STOP_REASON = {"type": ["integer", "string", "null"]}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def response_components() -> dict[str, Any]:
    """Every written-out component schema, by name (request schemas are added after)."""
    top_logprob = _obj({"token": STR, "logprob": _NUM, "bytes": {"type": "array", "items": _INT}})
    usage = _obj(
        {
            "prompt_tokens": _INT,
            "completion_tokens": _INT,
            "total_tokens": _INT,
            # null unless --enable-prompt-tokens-details, as in vLLM (created_cache_tokens: chat)
            "prompt_tokens_details": {
                "anyOf": [
                    _obj({"cached_tokens": _INT, "created_cache_tokens": _INT}),
                    {"type": "null"},
                ]
            },
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
            "tokens": {"type": "array", "items": STR},
            "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
            "top_logprobs": {"type": "array", "items": {"type": ["object", "null"]}},
            "text_offset": {"type": "array", "items": _INT},
        }
    )
    ids = {"type": "array", "items": _INT}
    ids_or_null = {"type": ["array", "null"], "items": _INT}  # an answer's unasked-for ids
    common = {"id": STR, "object": STR, "created": _INT, "model": STR}
    # Tool calls and reasoning: a stream delta's call carries index, then id, type
    # and name once, then argument fragments.
    function = _obj({"name": STR, "arguments": STR})
    tool_call = _obj({"index": _INT, "id": STR, "type": STR, "function": function})
    parsed = {
        "tool_calls": {"type": "array", "items": tool_call},
        "reasoning_content": _NULLABLE_STR,
        "reasoning": _NULLABLE_STR,
    }
    chat_choice = _obj(
        {
            "index": _INT,
            "message": _obj({"role": STR, "content": _NULLABLE_STR, **parsed}),
            "logprobs": {"anyOf": [ref("ChatLogprobs"), {"type": "null"}]},
            "finish_reason": _NULLABLE_STR,
            "stop_reason": _STOP_REASON,
            "token_ids": ids_or_null,
        },
        ["index", "message", "finish_reason"],
    )
    chat_chunk_choice = _obj(
        {
            "index": _INT,
            "delta": _obj({"role": STR, "content": _NULLABLE_STR, **parsed}),
            "logprobs": {"anyOf": [ref("ChatLogprobs"), {"type": "null"}]},
            "finish_reason": _NULLABLE_STR,
            "stop_reason": _STOP_REASON,
            "token_ids": ids,
        },
        ["index", "delta"],
    )
    completion_choice = _obj(
        {
            "index": _INT,
            "text": STR,
            "logprobs": {"anyOf": [ref("CompletionLogprobs"), {"type": "null"}]},
            "finish_reason": _NULLABLE_STR,
            "stop_reason": _STOP_REASON,
            "prompt_token_ids": ids_or_null,
            "token_ids": ids_or_null,
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
                "usage": ref("Usage"),
                "prompt_token_ids": ids_or_null,
                "prompt_logprobs": {"type": ["array", "null"]},
            },
            ["id", "object", "created", "model", "choices", "usage"],
        ),
        "ChatCompletionChunk": _obj(
            {
                **common,
                "choices": listing(chat_chunk_choice),
                "usage": {"anyOf": [ref("Usage"), {"type": "null"}]},
            },
            ["id", "object", "created", "model", "choices"],
        ),
        "CompletionResponse": _obj(
            {**common, "choices": listing(completion_choice), "usage": ref("Usage")},
            ["id", "object", "created", "model", "choices", "usage"],
        ),
        "CompletionChunk": _obj(
            {
                **common,
                "choices": listing(completion_choice),
                "usage": {"anyOf": [ref("Usage"), {"type": "null"}]},
            },
            ["id", "object", "created", "model", "choices"],
        ),
        "ModelList": _obj(
            {
                "object": STR,
                "data": listing(
                    _obj(
                        {
                            "id": STR,
                            "object": STR,
                            "created": _INT,
                            "owned_by": STR,
                            "root": _NULLABLE_STR,
                            "max_model_len": _INT,
                        },
                        ["id", "object"],
                    )
                ),
            },
            ["object", "data"],
        ),
        "TokenizeResponse": _obj(
            {
                "count": _INT,
                "max_model_len": _INT,
                "tokens": ids,
                "token_strs": {**listing(STR), "type": ["array", "null"]},
            },
            ["count", "max_model_len", "tokens"],
        ),
        "DetokenizeResponse": _obj({"prompt": STR}, ["prompt"]),
        **_embedding_components(),
        **_responses_components(),
        "ServerLoad": _obj({"server_load": _INT}, ["server_load"]),
        "VersionResponse": _obj({"version": STR}, ["version"]),
        "Error": _obj(
            {
                "error": _obj(
                    {"message": STR, "type": STR, "param": _NULLABLE_STR, "code": _INT},
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
            "input_tokens_details": _obj({"cached_tokens": _INT, "cache_write_tokens": _INT}),
            "output_tokens": _INT,
            "output_tokens_details": _obj({"reasoning_tokens": _INT}),
            "total_tokens": _INT,
        },
        ["input_tokens", "output_tokens", "total_tokens"],
    )
    part = _obj({"type": {"enum": ["output_text", "reasoning_text"]}, "text": STR}, ["type"])
    item = _obj(
        {
            "id": STR,
            "type": {"enum": ["message", "reasoning", "function_call"]},
            "status": STR,
            "role": STR,
            "content": {"type": "array", "items": part},
            "summary": {"type": "array"},
            "call_id": STR,
            "name": STR,
            "arguments": STR,
        },
        ["id", "type"],
    )
    response = _obj(
        {
            "id": STR,
            "object": {"const": "response"},
            "created_at": _INT,
            "status": {"enum": ["in_progress", "completed", "incomplete"]},
            "incomplete_details": {"type": ["object", "null"]},
            "model": STR,
            "output": {"type": "array", "items": ref("ResponseOutputItem")},
            "usage": {"anyOf": [ref("ResponseUsage"), {"type": "null"}]},
            "metadata": {"type": "object", "additionalProperties": STR},
        },
        ["id", "object", "created_at", "status", "model", "output"],
    )
    event = _obj(
        {
            "type": STR,
            "sequence_number": _INT,
            "response": ref("Response"),
            "item": ref("ResponseOutputItem"),
            "part": part,
            "item_id": STR,
            "output_index": _INT,
            "content_index": _INT,
            "delta": STR,
            "text": STR,
            "arguments": STR,
        },
        ["type", "sequence_number"],
    )
    return {
        "ResponseUsage": usage,
        "ResponseOutputItem": item,
        "Response": response,
        "ResponseStreamEvent": event,
    }


def _embedding_components() -> dict[str, Any]:
    vector = {
        "anyOf": [
            {"type": "array", "items": {"type": "number"}},
            {"type": "string", "description": "base64 of float32 little-endian"},
        ]
    }
    usage = _obj({"prompt_tokens": _INT, "total_tokens": _INT}, ["prompt_tokens", "total_tokens"])
    number = {"type": "number"}

    def listing_of(item: dict[str, Any]) -> dict[str, Any]:
        return _obj(
            {
                "id": STR,
                "object": STR,
                "created": _INT,
                "model": STR,
                "data": {"type": "array", "items": item},
                "usage": usage,
            },
            ["object", "model", "data", "usage"],
        )

    return {
        "EmbeddingResponse": listing_of(
            _obj(
                {"index": _INT, "object": STR, "embedding": vector},
                ["index", "object", "embedding"],
            )
        ),
        "PoolingResponse": listing_of(
            _obj({"index": _INT, "object": STR, "data": vector}, ["index", "object", "data"])
        ),
        "ClassificationResponse": listing_of(
            _obj(
                {
                    "index": _INT,
                    "label": STR,
                    "probs": {"type": "array", "items": {"type": "number"}},
                    "num_classes": _INT,
                },
                ["index", "label", "probs", "num_classes"],
            )
        ),
        "ScoreResponse": listing_of(
            _obj({"index": _INT, "object": STR, "score": number}, ["index", "object", "score"])
        ),
        "RerankResponse": _obj(
            {
                "id": STR,
                "model": STR,
                "usage": usage,
                "results": {
                    "type": "array",
                    "items": _obj(
                        {
                            "index": _INT,
                            "relevance_score": number,
                            "document": _obj({"text": STR}, ["text"]),
                        },
                        ["index", "relevance_score"],
                    ),
                },
            },
            ["id", "model", "usage", "results"],
        ),
    }
