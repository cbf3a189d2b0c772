"""An Anthropic Messages request as the chat completion request it means.

``system`` becomes the first (system) message, its text blocks that message's text parts;
a user turn's ``text`` / ``image`` blocks become its content parts, and each ``tool_result``
block a ``tool`` message (in the order given: a result after text splits the turn there); an
assistant turn's ``text`` blocks are its content, its ``tool_use`` blocks its ``tool_calls``
(the input object as the call's arguments) and its ``thinking`` blocks its
``reasoning_content``. Tools are function tools (``input_schema`` as the parameters) and
``tool_choice`` auto / any / tool / none is chat's auto / required / named / none
(``disable_parallel_tool_use``: ``parallel_tool_calls`` false). Every block, tool and choice is
checked key by key: an unknown key, a block type or a value this server cannot honour is a 400
naming its path.
"""

from __future__ import annotations

from typing import Any

from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.anthropic import CountTokensRequest, MessagesRequest
from trillm.entrypoints.openai.schemas.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    ImageURL,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    ToolCall,
)

# The keys each block type may have; ``cache_control`` is a caching hint (below).
_BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "image": {"type", "source", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
}
_ROLE_BLOCKS = {
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", "thinking"),
}
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict"}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat_request(
    req: CountTokensRequest, request_id: str, takes_images: bool
) -> ChatCompletionRequest:
    """The chat request ``req`` means (``takes_images``: the model takes image inputs)."""
    messages = _system(req.system) + to_messages(req.messages, takes_images)
    choice, parallel = _tool_choice(req.tool_choice)
    chat = ChatCompletionRequest(
        messages=messages,
        model=req.model,
        tools=_tools(req.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=req.chat_template_kwargs,
        request_id=request_id,
    )
    _check_cache_control(req.cache_control, "")
    _thinking(chat, req.thinking)
    if isinstance(req, MessagesRequest):
        chat.max_tokens = req.max_tokens
        chat.stop = req.stop_sequences
        chat.temperature = req.temperature
        chat.top_p = req.top_p
        chat.top_k = req.top_k
        chat.stream = req.stream
        chat.user = (req.metadata or {}).get("user_id")
    return chat


def _thinking(chat: ChatCompletionRequest, thinking: dict[str, Any] | None) -> None:
    """vLLM's mapping: a budget caps the reasoning section (thinking_token_budget, which needs
    --reasoning-parser); disabled asks the template for no thinking (reasoning_effort "none",
    which chat_template_kwargs' enable_thinking overrides); adaptive pins nothing."""
    kind = (thinking or {}).get("type")
    if kind == "enabled":
        chat.thinking_token_budget = (thinking or {})["budget_tokens"]
    elif kind == "disabled":
        chat.reasoning_effort = "none"


# ---------------------------------------------------------------- messages


def _system(system: str | list[dict[str, Any]] | None) -> list[ChatMessage]:
    if system is None:
        return []
    if isinstance(system, str):
        return [ChatMessage(role="system", content=system)]
    parts = []
    for i, block in enumerate(system):
        path = f"system[{i}]"
        if _block_type(block, path) != "text":
            raise BadRequestError(f"'{path}' must be a text block.", f"{path}.type")
        parts.append(_text_part(block, path))
    return [ChatMessage(role="system", content=parts)]


def to_messages(messages: list[dict[str, Any]], takes_images: bool) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequestError(f"'{path}' must be an object.", path)
        _check_keys(message, {"role", "content"}, path)
        role = message.get("role")
        if role not in _ROLE_BLOCKS:
            raise BadRequestError(
                f"'{path}.role' must be 'user' or 'assistant', got {role!r} (a system prompt "
                "goes in the top-level 'system').",
                f"{path}.role",
            )
        content = message.get("content")
        if isinstance(content, str):
            out.append(ChatMessage(role=role, content=content))
        elif isinstance(content, list):
            if role == "user":
                out.extend(_user_turn(content, path, takes_images))
            else:
                out.append(_assistant_turn(content, path))
        else:
            raise BadRequestError(
                f"'{path}.content' must be a string or an array of content blocks.",
                f"{path}.content",
            )
    return out


def _user_turn(blocks: list[Any], path: str, takes_images: bool) -> list[ChatMessage]:
    """A user turn's messages: its text and images, and a ``tool`` message per result."""
    out: list[ChatMessage] = []
    parts: list[TextPart] = []
    for j, block in enumerate(blocks):
        bpath = f"{path}.content[{j}]"
        kind = _block_type(block, bpath, _ROLE_BLOCKS["user"])
        if kind == "text":
            parts.append(_text_part(block, bpath))
        elif kind == "image":
            parts.append(_image_part(block, bpath, takes_images))
        else:
            if parts:  # text before a result is its own user message, in its place
                out.append(ChatMessage(role="user", content=parts))
                parts = []
            out.append(_tool_result(block, bpath))
    if parts or not out:
        out.append(ChatMessage(role="user", content=parts))
    return out


def _assistant_turn(blocks: list[Any], path: str) -> ChatMessage:
    parts: list[TextPart] = []
    calls: list[ToolCall] = []
    thinking: list[str] = []
    for j, block in enumerate(blocks):
        bpath = f"{path}.content[{j}]"
        kind = _block_type(block, bpath, _ROLE_BLOCKS["assistant"])
        if kind == "text":
            parts.append(_text_part(block, bpath))
        elif kind == "tool_use":
            calls.append(_tool_use(block, bpath))
        else:
            thinking.append(_str(block, "thinking", bpath))
    return ChatMessage(
        role="assistant",
        content=parts if parts or not calls else None,
        tool_calls=calls or None,
        reasoning_content="".join(thinking) if thinking else None,
    )


# ---------------------------------------------------------------- blocks


def _block_type(block: Any, path: str, allowed: tuple[str, ...] = ("text",)) -> str:
    if not isinstance(block, dict):
        raise BadRequestError(f"'{path}' must be a content block (an object).", path)
    kind = block.get("type")
    if kind not in allowed:
        raise BadRequestError(
            f"Content blocks of type {kind!r} are not supported here ({', '.join(allowed)} are).",
            f"{path}.type",
        )
    _check_keys(block, _BLOCK_KEYS[kind], path)
    _check_cache_control(block.get("cache_control"), path)
    return str(kind)


def _text_part(block: dict[str, Any], path: str) -> TextPart:
    if block.get("citations"):
        raise BadRequestError(
            "Citations are not supported (no documents are cited here).", f"{path}.citations"
        )
    return TextPart(type="text", text=_str(block, "text", path))


def _image_part(block: dict[str, Any], path: str, takes_images: bool) -> TextPart:
    if not takes_images:
        raise BadRequestError(
            "Image content blocks are not supported: this model takes no image inputs.",
            f"{path}.type",
        )
    source = block.get("source")
    spath = f"{path}.source"
    if not isinstance(source, dict):
        raise BadRequestError(f"'{spath}' must be an object.", spath)
    kind = source.get("type")
    if kind == "url":
        _check_keys(source, {"type", "url"}, spath)
        return TextPart(type="image_url", image_url=ImageURL(_str(source, "url", spath)))
    if kind != "base64":
        raise BadRequestError(
            f"Image sources of type {kind!r} are not supported (base64 and url are).",
            f"{spath}.type",
        )
    _check_keys(source, {"type", "media_type", "data"}, spath)
    media_type = source.get("media_type")
    if media_type not in _IMAGE_TYPES:
        raise BadRequestError(
            f"'{spath}.media_type' must be one of {', '.join(_IMAGE_TYPES)}.",
            f"{spath}.media_type",
        )
    url = f"data:{media_type};base64,{_str(source, 'data', spath)}"
    return TextPart(type="image_url", image_url=ImageURL(url))


def _tool_use(block: dict[str, Any], path: str) -> ToolCall:
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise BadRequestError(f"'{path}.input' must be an object.", f"{path}.input")
    name = _str(block, "name", path)
    return ToolCall(id=_str(block, "id", path), function=FunctionCall(name, arguments))


def _tool_result(block: dict[str, Any], path: str) -> ChatMessage:
    if block.get("is_error"):
        # NOTE: chat templates have no way to mark a tool result as failed; saying so in
        # words would put text in the prompt the client did not write.
        raise BadRequestError(
            "'is_error' true is not supported: chat templates cannot mark a tool result as an "
            "error; send the error text as the result's content.",
            f"{path}.is_error",
        )
    content = block.get("content", "")
    cpath = f"{path}.content"
    if isinstance(content, list):
        parts = []
        for k, inner in enumerate(content):
            ipath = f"{cpath}[{k}]"
            _block_type(inner, ipath)  # text only: images in tool results are not rendered
            parts.append(_text_part(inner, ipath))
        content = parts
    elif not isinstance(content, str):
        raise BadRequestError(f"'{cpath}' must be a string or an array of text blocks.", cpath)
    return ChatMessage(role="tool", content=content, tool_call_id=_str(block, "tool_use_id", path))


def _check_cache_control(value: Any, path: str) -> None:
    """``cache_control`` marks a prompt prefix to cache: this server caches every prefix
    itself (--enable-prefix-caching), so the mark asks for nothing more; only its known
    form is accepted."""
    if value is None:
        return
    ok = isinstance(value, dict) and value.get("type") == "ephemeral"
    if not ok or not set(value) <= {"type", "ttl"} or value.get("ttl") not in (None, "5m", "1h"):
        name = f"{path}.cache_control" if path else "cache_control"
        raise BadRequestError(
            f"'{name}' must be {{\"type\": \"ephemeral\"}} (with an optional ttl of '5m' or '1h').",
            name,
        )


# ---------------------------------------------------------------- tools


def _tools(tools: list[dict[str, Any]] | None) -> list[ChatTool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequestError(f"'{path}' must be an object.", path)
        if tool.get("type") not in (None, "custom"):
            raise BadRequestError(
                f"Tools of type {tool.get('type')!r} are not available: this server runs no "
                "server tools; declare client tools with a name and an input_schema.",
                f"{path}.type",
            )
        _check_keys(tool, _TOOL_KEYS, path)
        _check_cache_control(tool.get("cache_control"), path)
        if tool.get("strict"):
            raise BadRequestError(
                "'strict' tools are not supported; tool_choice 'any' or 'tool' constrains the "
                "call to the tool's input_schema.",
                f"{path}.strict",
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise BadRequestError(
                f"'{path}.input_schema' must be a JSON schema object.", f"{path}.input_schema"
            )
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequestError(f"'{path}.description' must be a string.", f"{path}.description")
        out.append(ChatTool(FunctionDefinition(_str(tool, "name", path), description, schema)))
    return out


def _tool_choice(
    choice: dict[str, Any] | None,
) -> tuple[str | NamedToolChoice | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, True
    kind = choice.get("type")
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    _check_keys(choice, keys, "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise BadRequestError(
            "'tool_choice.disable_parallel_tool_use' must be a boolean.",
            "tool_choice.disable_parallel_tool_use",
        )
    parallel = not disable
    if kind == "tool":
        return NamedToolChoice(NamedFunction(_str(choice, "name", "tool_choice"))), parallel
    if kind not in _CHOICES:
        raise BadRequestError(
            f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}.",
            "tool_choice.type",
        )
    return _CHOICES[kind], parallel


# ---------------------------------------------------------------- checks


def _check_keys(obj: dict[str, Any], allowed: set[str], path: str) -> None:
    for key in obj:
        if key not in allowed:
            name = f"{path}.{str(key)[:64]}"
            raise BadRequestError(f"Unknown field '{name}': it is not supported here.", name)


def _str(obj: dict[str, Any], name: str, path: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise BadRequestError(f"'{path}.{name}' must be a string.", f"{path}.{name}")
    return value
