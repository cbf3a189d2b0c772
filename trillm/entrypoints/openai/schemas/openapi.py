"""The OpenAPI 3.1 description of the server, served at GET /openapi.json: its paths and
operations. Request schemas are generated from the attrs classes (``openapi_requests.py``);
response schemas are written out in ``openapi_responses.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import trillm
from trillm.entrypoints.openai.schemas.openapi_request_schemas import add_request_schemas
from trillm.entrypoints.openai.schemas.openapi_response_schemas import STR, ref, response_components


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": ref(name)}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "Invalid request",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "Body too large",
        500: "Engine failure",
        503: "Not ready, draining or engine dead",
    }
    return {str(c): {"description": text[c], "content": _json("Error")} for c in codes}


def _sse_event(chunk: str) -> dict[str, Any]:
    # Before OpenAPI 3.2 the schema of text/event-stream describes one event (its fields),
    # not the stream as a string. Each event's data is a JSON chunk, an error after the stream
    # started, or the final [DONE].
    payload = {"anyOf": [ref(chunk), ref("Error")]}
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
            "event": STR,
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": ref("ResponseStreamEvent"),
            },
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
            },
        }
    }


def _anthropic_op(summary: str, request: str, answer: str, stream: bool) -> dict[str, Any]:
    """A Messages API route: its answers (and errors) in Anthropic's shapes."""
    obj = {"type": "object"}
    content: dict[str, Any] = {"application/json": {"schema": obj}}
    if stream:  # each event an `event: <type>` line and a `data: <JSON>` line
        event = {"type": "object", "properties": {"event": STR, "data": STR}}
        content["text/event-stream"] = {"schema": {**event, "required": ["event", "data"]}}
    error = {"content": {"application/json": {"schema": obj}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {"description": answer, "content": content},
                **{
                    str(code): {"description": f"An Anthropic error ({text})", **error}
                    for code, text in (
                        (400, "invalid_request_error"),
                        (401, "authentication_error"),
                        (404, "not_found_error"),
                        (503, "overloaded_error"),
                    )
                },
            },
        }
    }


@functools.cache
def build_spec() -> dict[str, Any]:
    components = response_components()
    add_request_schemas(components)
    text = {"text/plain": {"schema": {"type": "string"}}}
    paths = {
        "/v1/chat/completions": _generate_op(
            "Chat completion",
            "ChatCompletionRequest",
            "ChatCompletionResponse",
            "ChatCompletionChunk",
        ),
        "/v1/completions": _generate_op(
            "Text completion", "CompletionRequest", "CompletionResponse", "CompletionChunk"
        ),
        "/v1/models": {
            "get": {
                "summary": "The served model(s)",
                "responses": {
                    "200": {"description": "OK", "content": _json("ModelList")},
                    **_errors(401),
                },
            }
        },
        "/tokenize": _simple_post(
            "Tokenize a prompt or a chat", "TokenizeRequest", "TokenizeResponse"
        ),
        "/detokenize": _simple_post("Token ids to text", "DetokenizeRequest", "DetokenizeResponse"),
        "/v1/embeddings": _simple_post(
            "Embeddings of a pooling model (--runner pooling)",
            "EmbeddingRequest",
            "EmbeddingResponse",
        ),
        "/pooling": _simple_post(
            "Pooled vectors of a pooling model (vLLM's /pooling)",
            "PoolingRequest",
            "PoolingResponse",
        ),
        "/classify": _simple_post(
            "Class probabilities of a sequence classifier (vLLM's /classify)",
            "ClassificationRequest",
            "ClassificationResponse",
        ),
        **{
            path: _simple_post(
                "Scores of text pairs: a cross-encoder's, or an embedding model's cosine "
                "similarity (vLLM's /score)",
                "ScoreRequest",
                "ScoreResponse",
            )
            for path in ("/score", "/v1/score")
        },
        **{
            path: _simple_post(
                "Documents ranked by their score against a query (vLLM's Jina / Cohere-"
                "compatible /rerank)",
                "RerankRequest",
                "RerankResponse",
            )
            for path in ("/rerank", "/v1/rerank", "/v2/rerank")
        },
        "/v1/responses": _responses_op(),
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "A stored response (VLLM_ENABLE_RESPONSES_API_STORE=1; else 404)",
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": STR}
                ],
                "responses": {
                    "200": {"description": "The stored Response", "content": _json("Response")},
                    **_errors(400, 401, 404),
                },
            }
        },
        "/v1/responses/{response_id}/cancel": {
            "post": {
                "summary": "Cancel a running background response (a finished one: vLLM's 400 "
                "'Cannot cancel a synchronous response.')",
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": STR}
                ],
                "responses": {
                    "200": {"description": "The response, cancelled", "content": _json("Response")},
                    **_errors(400, 401, 404),
                },
            }
        },
        "/v1/messages": _anthropic_op(
            "Anthropic Messages API (text, images, client tools, thinking blocks)",
            "AnthropicMessagesRequest",
            "A message, or with stream=true Anthropic's SSE events (message_start ... "
            "message_stop).",
            stream=True,
        ),
        "/v1/messages/count_tokens": _anthropic_op(
            "The input tokens of a Messages request",
            "AnthropicCountTokensRequest",
            '{"input_tokens": N}',
            stream=False,
        ),
        "/invocations": {
            "post": {
                "summary": "SageMaker's inference route: a chat completion body (with "
                "'messages') or a completion body (with 'prompt')",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "anyOf": [ref("ChatCompletionRequest"), ref("CompletionRequest")]
                            }
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": "As /v1/chat/completions or /v1/completions",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "anyOf": [
                                        ref("ChatCompletionResponse"),
                                        ref("CompletionResponse"),
                                    ]
                                }
                            }
                        },
                    },
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
            }
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
