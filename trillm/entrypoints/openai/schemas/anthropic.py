"""Anthropic's Messages API requests (POST /v1/messages, /v1/messages/count_tokens): their
schemas and their refusals.

As on /v1/responses, a field this server does not implement is refused (400 naming it) rather
than ignored: Anthropic's API has hosted features (server tools, MCP servers, containers)
whose silent absence would change what a client gets. The nested
objects (content blocks, tools, ``tool_choice``, ``metadata``) are kept as JSON objects here and
checked key by key where they are turned into a chat request (``endpoints/anthropic_convert``),
which names the bad key's path.
"""

from __future__ import annotations

from typing import Any, Union

import attrs

from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import (
    MAX_CHAT_CONTENT_PARTS,
    MAX_CHAT_MESSAGES,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    _f,
)
from trillm.entrypoints.openai.schemas.structuring import structure_body

MAX_SYSTEM_BLOCKS = 1024
MAX_TOOLS = 1024  # as chat completions' ``tools``


@attrs.define(kw_only=True)
class CountTokensRequest:
    model: str
    messages: list[dict[str, Any]] = _f(max_len=MAX_CHAT_MESSAGES, max_parts=MAX_CHAT_CONTENT_PARTS)
    # A string, or text blocks (each a content part of one system message).
    system: Union[str, list[dict[str, Any]], None] = _f(None, max_len=MAX_SYSTEM_BLOCKS)  # noqa: UP007
    tools: list[dict[str, Any]] | None = _f(None, max_len=MAX_TOOLS)
    # {"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}
    tool_choice: dict[str, Any] | None = None
    # vLLM's extension, as on chat completions: the chat template's extra variables.
    chat_template_kwargs: dict[str, Any] | None = None
    # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"} | {"type": "adaptive"}
    # (check_thinking; anthropic_convert maps it to chat's fields as vLLM does)
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # a caching mark (anthropic_convert.py)


@attrs.define(kw_only=True)
class MessagesRequest(CountTokensRequest):
    max_tokens: int = _f(ge=1)
    stop_sequences: list[str] | None = _f(None, max_len=MAX_STOP_STRINGS)
    # Anthropic's ranges: temperature 0-1, top_k >= 0 (0: all tokens).
    temperature: float | None = _f(None, ge=0.0, le=1.0)
    top_p: float | None = _f(None, gt=0.0, le=1.0)
    top_k: int | None = _f(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # {"user_id": str}
    service_tier: str | None = None  # "auto" / "standard_only": one tier here


# Fields of Anthropic's API this server does not implement, and why (the 400's text). Their
# "off" values (null, false, []) ask for nothing and pass.
REFUSED_FIELDS = {
    "container": "code execution containers are not available on this server",
    "mcp_servers": "MCP servers are not called by this server; declare the tools in 'tools'",
    "context_management": "context editing is not implemented; send the conversation to keep",
    "output_config": "output formats and effort are not implemented on /v1/messages; use "
    "/v1/chat/completions' response_format for JSON output",
    "output_format": "output formats are not implemented on /v1/messages; use "
    "/v1/chat/completions' response_format for JSON output",
}
SERVICE_TIERS = ("auto", "standard_only")
MAX_USER_ID_CHARS = 256


def check_fields(body: dict[str, Any], cls: type[CountTokensRequest], route: str) -> None:
    """400 for a field this server refuses or does not know, naming it."""
    known = {f.name for f in attrs.fields(cls)}
    for name, value in body.items():
        if name in known:
            continue
        reason = REFUSED_FIELDS.get(name)
        if reason is None:
            raise BadRequestError(
                f"Unknown field '{name}': {route} refuses the fields it does not implement.",
                name,
            )
        if value is not None and value is not False and value != []:
            raise BadRequestError(f"'{name}' is not supported: {reason}.", name)


def check_values(req: CountTokensRequest) -> None:
    """400 for values of known fields this server cannot honour, naming the field."""
    check_thinking(req.thinking, getattr(req, "max_tokens", None))
    for i, stop in enumerate(getattr(req, "stop_sequences", None) or []):
        if not stop or len(stop) > MAX_STOP_STRING_LEN:
            raise BadRequestError(
                f"Each stop sequence must have 1 to {MAX_STOP_STRING_LEN} characters.",
                f"stop_sequences[{i}]",
            )
    if getattr(req, "service_tier", None) not in (None, *SERVICE_TIERS):
        raise BadRequestError(
            f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}; this server has one tier.",
            "service_tier",
        )
    metadata = getattr(req, "metadata", None)
    if metadata is not None:
        _check_metadata(metadata)


# vLLM's minimum budget (Anthropic's): a smaller one is a 400.
MIN_THINKING_BUDGET = 1024
THINKING_KEYS = {
    "enabled": {"type", "budget_tokens", "display"},
    "disabled": {"type"},
    "adaptive": {"type", "display"},
}
# thinking.display values this server honours: the reasoning is always returned in full.
THINKING_DISPLAYS = (None, "summarized")


def check_thinking(thinking: dict[str, Any] | None, max_tokens: int | None) -> None:
    """400 naming ``thinking.*`` for a configuration vLLM's Messages API would not take, or a
    display this server cannot give (the reasoning is returned whole, never omitted)."""
    if thinking is None:
        return
    kind = thinking.get("type")
    allowed = THINKING_KEYS.get(kind) if isinstance(kind, str) else None
    if allowed is None:
        raise BadRequestError(
            "'thinking.type' must be 'enabled', 'disabled' or 'adaptive'.", "thinking.type"
        )
    for key in thinking:
        if key not in allowed:
            raise BadRequestError(
                f"Unknown field 'thinking.{str(key)[:64]}' for thinking type {kind!r}.",
                f"thinking.{str(key)[:64]}",
            )
    if thinking.get("display") not in THINKING_DISPLAYS:
        raise BadRequestError(
            "'thinking.display' other than 'summarized' is not supported: the reasoning is "
            "always returned in full as a 'thinking' block.",
            "thinking.display",
        )
    if kind != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
        raise BadRequestError(
            f"'thinking.budget_tokens' must be a whole number >= {MIN_THINKING_BUDGET}.",
            "thinking.budget_tokens",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise BadRequestError(
            "'thinking.budget_tokens' must be less than max_tokens.", "thinking.budget_tokens"
        )


def _check_metadata(metadata: dict[str, Any]) -> None:
    for key, value in metadata.items():
        if key != "user_id":
            raise BadRequestError(
                f"Unknown field 'metadata.{key[:64]}': metadata has only 'user_id'.",
                f"metadata.{key[:64]}",
            )
        if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_ID_CHARS):
            raise BadRequestError(
                f"'metadata.user_id' must be a string of at most {MAX_USER_ID_CHARS} characters.",
                "metadata.user_id",
            )


async def parse_messages(body: dict[str, Any], body_bytes: int | None) -> MessagesRequest:
    check_fields(body, MessagesRequest, "/v1/messages")
    req: MessagesRequest = await structure_body(MessagesRequest, body, body_bytes)
    check_values(req)
    return req


async def parse_count_tokens(body: dict[str, Any], body_bytes: int | None) -> CountTokensRequest:
    check_fields(body, CountTokensRequest, "/v1/messages/count_tokens")
    req: CountTokensRequest = await structure_body(CountTokensRequest, body, body_bytes)
    check_values(req)
    return req
