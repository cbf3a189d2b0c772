"""The OpenAI Responses API request (POST /v1/responses): its schema and its refusals.

Unlike the chat and completion bodies, a Responses body with a field this server does not
implement is refused (400 naming the field) rather than ignored with a warning: the API has
many stateful or hosted features (background runs, conversations, hosted tools) whose silent
absence would change what a client gets. ``input`` items are checked where they are turned into
chat messages (``serving_responses.to_messages``), which names the bad item's path.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import attrs

from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_CHAT_CONTENT_PARTS,
    MAX_REQUEST_ID_CHARS,
    MAX_REQUEST_TIMEOUT_S,
    _f,
)
from trillm.entrypoints.openai.schemas.structuring import structure_body
from trillm.sampling_params import INT64_MAX, INT64_MIN

MAX_INPUT_ITEMS = 100_000
# OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


@attrs.define
class ResponsesFunctionTool:
    # NOTE: ``type`` first: a hosted tool ({"type": "web_search"}) is refused by its type,
    # before its missing ``name`` is noticed.
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.define
class ResponsesToolChoiceFunction:
    type: Literal["function"]
    name: str


@attrs.define
class ResponsesTextFormat:
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


@attrs.define
class ResponsesText:
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None  # refused unless null: no mechanism here


@attrs.define
class ResponsesReasoning:
    # Given to the chat template as ``reasoning_effort`` (as vLLM does); templates that do not
    # read it ignore it, as in vLLM.
    effort: str | None = None  # one of REASONING_EFFORTS
    summary: str | None = None  # refused unless null: no summaries are written
    generate_summary: str | None = None  # the older name of ``summary``


@attrs.define(kw_only=True)
class ResponsesRequest:
    input: Union[str, list[dict[str, Any]]] = _f(  # noqa: UP007
        max_len=MAX_INPUT_ITEMS, max_parts=MAX_CHAT_CONTENT_PARTS
    )
    instructions: str | None = None
    model: str | None = None
    max_output_tokens: int | None = _f(None, ge=1)
    temperature: float | None = _f(None, ge=0.0, le=2.0)
    top_p: float | None = _f(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[ResponsesFunctionTool] | None = _f(None, max_len=1024)
    # "none" | "auto" | "required" | {"type": "function", "name": ...}
    tool_choice: Union[str, ResponsesToolChoiceFunction, None] = None  # noqa: UP007
    parallel_tool_calls: bool | None = True
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: dict[str, str] | None = _f(None, max_len=MAX_METADATA_PAIRS)
    user: str | None = None
    # Kept for GET /v1/responses/{id} and previous_response_id with
    # VLLM_ENABLE_RESPONSES_API_STORE=1 (responses_store.py); else ignored, as in vLLM.
    store: bool | None = True
    previous_response_id: str | None = _f(None, max_chars=MAX_REQUEST_ID_CHARS)
    # vLLM's: the prompt and the output as raw text and token ids ('input_messages',
    # 'output_messages'); not with stream (vLLM gives them with the whole response only).
    enable_response_messages: bool = False
    # Run after the answer, read with GET /v1/responses/{id} (responses_background.py).
    background: bool | None = False
    truncation: str | None = None  # "disabled"; "auto" is refused
    service_tier: str | None = None  # "auto" / "default" only: one tier here
    # vLLM extensions (as on chat completions)
    top_k: int | None = _f(None, ge=-1)
    min_p: float | None = _f(None, ge=0.0, le=1.0)
    presence_penalty: float | None = _f(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = _f(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = _f(None, gt=0.0)
    seed: int | None = _f(None, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = _f(None, max_chars=MAX_REQUEST_ID_CHARS)
    priority: int = 0
    cache_salt: str | None = _f(None, max_chars=MAX_CACHE_SALT_CHARS)
    timeout: float | None = _f(None, gt=0.0, le=MAX_REQUEST_TIMEOUT_S)
    vllm_xargs: dict[str, Any] | None = _f(None, max_len=256)  # -> extra_args, as on chat
    thinking_token_budget: int | None = _f(None, ge=-1)  # as on chat (--reasoning-parser)


# Fields of OpenAI's Responses API this server does not implement, and why (the 400's text).
REFUSED_FIELDS = {
    "conversation": "conversations are not stored; send the whole conversation in 'input'",
    "include": "none of the optional output data (logprobs, encrypted reasoning, tool "
    "results) is produced",
    "top_logprobs": "logprobs are not returned on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "no hosted tools run here, and function calls are bounded by "
    "'parallel_tool_calls'",
    "prompt": "stored prompt templates are not kept here",
    "prompt_cache_key": "prefix caching is automatic; use 'cache_salt' to separate caches",
    "prompt_cache_retention": "prefix caching is automatic",
    "safety_identifier": "no moderation runs here",
    "stream_options": "stream obfuscation is not implemented",
    "context_management": "context compaction is not implemented",
}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
_KNOWN = {f.name for f in attrs.fields(ResponsesRequest)}


def check_fields(body: dict[str, Any]) -> None:
    """400 for a field this server refuses or does not know, naming it."""
    for name, value in body.items():
        if name in _KNOWN:
            continue
        reason = REFUSED_FIELDS.get(name)
        if reason is None:
            raise BadRequestError(
                f"Unknown field '{name}': /v1/responses refuses the fields it does not implement.",
                name,
            )
        if value is None or value is False or value == []:
            continue  # the field's "off" value asks for nothing
        raise BadRequestError(f"'{name}' is not supported: {reason}.", name)


def check_values(req: ResponsesRequest) -> None:
    """400 for values of known fields this server cannot honour, naming the field."""
    if req.enable_response_messages and req.stream:
        raise BadRequestError(
            "'enable_response_messages' is not supported with 'stream': the raw messages come "
            "with the whole response (stream=false).",
            "enable_response_messages",
        )
    if req.truncation not in (None, "disabled"):
        raise BadRequestError(
            f"'truncation' {req.truncation!r} is not supported (an input longer than the context is "
            "refused); use 'disabled'.",
            "truncation",
        )
    if req.service_tier not in (None, "auto", "default"):
        raise BadRequestError(
            f"'service_tier' {req.service_tier!r} is not available; this server has one tier "
            "('auto' / 'default').",
            "service_tier",
        )
    if req.text is not None and req.text.verbosity is not None:
        raise BadRequestError("'text.verbosity' is not supported.", "text.verbosity")
    reasoning = req.reasoning
    if reasoning is not None and reasoning.effort not in (None, *REASONING_EFFORTS):
        raise BadRequestError(
            f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}, got "
            f"{reasoning.effort!r}.",
            "reasoning.effort",
        )
    if reasoning is not None and (reasoning.summary or reasoning.generate_summary):
        param = "reasoning.summary" if reasoning.summary else "reasoning.generate_summary"
        raise BadRequestError(
            "Reasoning summaries are not written; the reasoning text comes whole in the "
            "'reasoning' output item (with --reasoning-parser).",
            param,
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema is None:
        raise BadRequestError(
            "'text.format.schema' is required when 'text.format.type' is 'json_schema'.",
            "text.format.schema",
        )
    for key, value in (req.metadata or {}).items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise BadRequestError(
                f"'metadata' keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"at most {MAX_METADATA_VALUE_CHARS}.",
                f"metadata.{key[:MAX_METADATA_KEY_CHARS]}",
            )


async def parse_request(body: dict[str, Any], body_bytes: int | None) -> ResponsesRequest:
    check_fields(body)
    req: ResponsesRequest = await structure_body(ResponsesRequest, body, body_bytes)
    check_values(req)
    return req
