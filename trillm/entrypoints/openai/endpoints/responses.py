"""POST /v1/responses (OpenAI's Responses API) on the chat path.

A Responses request is turned into the chat request it means (``input`` items into messages,
``instructions`` into a system message, function tools, ``text.format`` into
``response_format``, ``reasoning.effort`` into the template's ``reasoning_effort``), run by the
chat pipeline (``endpoints/chat.start_chat``: the same rendering, checks, tool and reasoning
parsing), and its output told as Responses output items: ``reasoning`` (with
--reasoning-parser), ``message`` (``output_text``) and ``function_call``. Streaming events are
written by ``responses_stream.py``. With VLLM_ENABLE_RESPONSES_API_STORE=1 finished responses
are kept for GET /v1/responses/{id} and ``previous_response_id`` (``responses_store.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import attrs
import trio

from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.chat import start_chat
from trillm.entrypoints.openai.endpoints.generation import guard_stream
from trillm.entrypoints.openai.endpoints.responses_background import (
    check_background,
    finished_unless_cancelled,
    start_background,
)
from trillm.entrypoints.openai.endpoints.responses_output import ResponseBuilder
from trillm.entrypoints.openai.endpoints.responses_store import history, not_found
from trillm.entrypoints.openai.endpoints.responses_stream import ResponseStream
from trillm.entrypoints.openai.http.errors import APIError, BadRequestError
from trillm.entrypoints.openai.schemas.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolCall,
)
from trillm.entrypoints.openai.schemas.responses import ResponsesRequest

# Roles an input message may have; "developer" is told to the template as "system" (chat
# templates know no developer role).
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
# An assistant turn holds as many calls as a chat message may (consecutive function_call items
# make one turn).
MAX_TURN_CALLS: int = attrs.fields(ChatMessage).tool_calls.metadata["max_len"]
# Inputs of more items and content parts than this are turned into a chat on a worker thread:
# ~2 us an item, and on the event loop that is every other request's wait.
CONVERT_OFF_LOOP_ITEMS = 2_000


async def create_response(
    state: ServerState, req: ResponsesRequest
) -> dict[str, Any] | AsyncIterator[bytes]:
    store = state.responses_store
    if req.background:
        check_background(store, req.stream)
    earlier = None
    if req.previous_response_id is not None:  # vLLM's 404 when not stored (or no store)
        if store is None:
            raise not_found(req.previous_response_id)
        earlier = history(store.get(req.previous_response_id))
    if _input_size(req.input) + len(earlier or ()) < CONVERT_OFF_LOOP_ITEMS:
        chat = to_chat_request(req, earlier)
    else:
        chat = await trio.to_thread.run_sync(to_chat_request, req, earlier)
    try:
        answer, gen = await start_chat(state, chat)
    except APIError as exc:
        raise rename_param(exc) from None
    # Kept once finished with VLLM_ENABLE_RESPONSES_API_STORE=1 and 'store' (the default);
    # without the variable 'store' is ignored, as in vLLM.
    keep: Callable[..., object] | None = None
    if store is not None and req.background:  # (vLLM keeps these whatever 'store' says)
        keep = finished_unless_cancelled(store, chat.messages)
    elif store is not None and req.store:
        keep = partial(store.keep, messages=chat.messages)
    built = ResponseBuilder(state, req, answer.request_id, keep)
    if req.stream:
        return guard_stream(gen, ResponseStream(built, answer).events(gen))

    async def whole() -> dict[str, Any]:
        body = await answer.full(gen)
        cached = answer.tracker.cache_totals()
        if req.enable_response_messages:
            skip = answer.params.skip_special_tokens
            return _with_raw_messages(state, built, body, cached, skip)
        return built.from_chat(body, cached)

    if store is not None and req.background:
        queued = built.body("queued", [], None)
        return start_background(state, store, queued, chat.messages, whole)
    return await whole()


def _with_raw_messages(
    state: ServerState,
    built: ResponseBuilder,
    chat: dict[str, Any],
    cached: tuple[int, int],
    skip_special: bool,
) -> dict[str, Any]:
    """vLLM's ``enable_response_messages``: the prompt and the output, each as its text and
    token ids (``raw_message_tokens``; the ids are the truth where the two differ)."""
    keep, built.on_finished = built.on_finished, None  # stored below, with the messages
    response = built.from_chat(chat, cached)
    prompt_ids = chat["prompt_token_ids"]
    out_ids = chat["choices"][0]["token_ids"] or []
    response["input_messages"] = [_raw(state.tokenizer.decode(prompt_ids), prompt_ids)]
    response["output_messages"] = (
        [_raw(state.tokenizer.decode(out_ids, skip_special_tokens=skip_special), out_ids)]
        if out_ids
        else []
    )
    if keep is not None:
        response["store"] = True
        keep(response)
    return response


def _raw(text: str, ids: list[int]) -> dict[str, Any]:
    return {"type": "raw_message_tokens", "message": text, "tokens": list(ids)}


# ---------------------------------------------------------------- request -> chat request


def _input_size(items: str | list[dict[str, Any]]) -> int:
    """Items and content parts of ``input``, counted up to CONVERT_OFF_LOOP_ITEMS."""
    if isinstance(items, str) or len(items) >= CONVERT_OFF_LOOP_ITEMS:
        return 0 if isinstance(items, str) else len(items)
    size = len(items)
    for item in items:
        content = item.get("content")
        size += len(content) if isinstance(content, list) else 0
    return size


def to_chat_request(
    req: ResponsesRequest, earlier: list[ChatMessage] | None = None
) -> ChatCompletionRequest:
    """The chat request ``req`` means; ``earlier``: the conversation it continues
    (``previous_response_id``), before its input."""
    messages = to_messages(req.input)
    if earlier:
        messages = [*earlier, *messages]
    if req.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    fmt = req.text.format if req.text is not None else None
    effort = req.reasoning.effort if req.reasoning is not None else None
    return ChatCompletionRequest(
        messages=messages,
        model=req.model,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=_chat_tools(req),
        tool_choice=_chat_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=None
        if fmt is None
        else ResponseFormat(
            type=fmt.type,
            json_schema=None
            if fmt.type != "json_schema"
            else JsonSchemaSpec(
                name=fmt.name or "response",
                schema=fmt.schema,
                description=fmt.description,
                strict=fmt.strict,
            ),
        ),
        chat_template_kwargs=None if effort is None else {"reasoning_effort": effort},
        user=req.user,
        request_id=req.request_id or f"resp_{uuid.uuid4().hex}",
        priority=req.priority,
        cache_salt=req.cache_salt,
        timeout=req.timeout,
        vllm_xargs=req.vllm_xargs,
        thinking_token_budget=req.thinking_token_budget,
        return_token_ids=req.enable_response_messages,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
    )


def _chat_tools(req: ResponsesRequest) -> list[ChatTool] | None:
    if req.tools is None:
        return None
    return [
        ChatTool(function=FunctionDefinition(t.name, t.description, t.parameters, t.strict))
        for t in req.tools
    ]


def _chat_tool_choice(req: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def to_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """``input`` as chat messages: a string is one user message; a list holds message items
    (role + text content), ``function_call`` items (an assistant turn's tool calls),
    ``function_call_output`` items (tool results) and ``reasoning`` items (the next
    assistant turn's reasoning). Anything else is a 400 naming the item."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise BadRequestError("'input' must not be empty.", "input")
    messages: list[ChatMessage] = []
    reasoning: list[str] | None = None  # reasoning items waiting for their assistant turn
    for i, item in enumerate(items):
        path = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role, content = _message(item, path)
            msg = ChatMessage(role=role, content=content)
            if role == "assistant" and reasoning is not None:
                msg.reasoning_content, reasoning = "".join(reasoning), None
            messages.append(msg)
        elif kind == "function_call":
            _add_call(messages, item, path)
            if reasoning is not None:
                messages[-1].reasoning_content, reasoning = "".join(reasoning), None
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise BadRequestError(f"'{path}.output' must be a string.", f"{path}.output")
            messages.append(
                ChatMessage(role="tool", content=output, tool_call_id=_str(item, "call_id", path))
            )
        elif kind == "reasoning":
            reasoning = reasoning if reasoning is not None else []
            reasoning.append(_reasoning_text(item, path))
        else:
            raise BadRequestError(
                f"Input items of type {kind!r} are not supported (message, function_call, "
                "function_call_output and reasoning are).",
                f"{path}.type",
            )
    if reasoning is not None:  # reasoning of a turn with no content or calls given
        messages.append(
            ChatMessage(role="assistant", content="", reasoning_content="".join(reasoning))
        )
    return messages


def _add_call(messages: list[ChatMessage], item: dict[str, Any], path: str) -> None:
    """A ``function_call`` item: a call of the assistant turn that ends ``messages``, or of a
    new one."""
    call = ToolCall(
        id=_str(item, "call_id", path),
        function=FunctionCall(
            name=_str(item, "name", path), arguments=_str(item, "arguments", path)
        ),
    )
    last = messages[-1] if messages else None
    # NOTE: the turn's list is this function's own (made below), so it grows in place: a
    # copy per call made 100,000 consecutive calls quadratic (25 s on the event loop).
    if last is None or last.role != "assistant":
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif last.tool_calls is None:  # the calls of a turn given with its text
        last.tool_calls = [call]
    elif len(last.tool_calls) < MAX_TURN_CALLS:
        last.tool_calls.append(call)
    else:
        raise BadRequestError(
            f"At most {MAX_TURN_CALLS} consecutive function_call items (the calls of one "
            "assistant turn) are allowed, as in a chat message's 'tool_calls'.",
            path,
        )


def _str(item: dict[str, Any], name: str, path: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadRequestError(f"'{path}.{name}' must be a string.", f"{path}.{name}")
    return value


def _message(item: dict[str, Any], path: str) -> tuple[str, str | list[TextPart]]:
    role = item.get("role")
    if role not in _ROLES:
        raise BadRequestError(
            f"'{path}.role' must be one of {', '.join(_ROLES)}, got {role!r}.", f"{path}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return _ROLES[role], content
    if not isinstance(content, list):
        raise BadRequestError(
            f"'{path}.content' must be a string or an array of text parts.", f"{path}.content"
        )
    parts = []
    for j, part in enumerate(content):
        ppath = f"{path}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise BadRequestError(
                f"Content parts of type {kind!r} are not supported (only text: input_text, "
                "output_text); this server serves text-only models.",
                f"{ppath}.type",
            )
        parts.append(TextPart(type="text", text=_str(part, "text", ppath)))
    return _ROLES[role], parts


def _reasoning_text(item: dict[str, Any], path: str) -> str:
    texts = []
    for key in ("content", "summary"):
        for j, part in enumerate(item.get(key) or []):
            texts.append(_str(part, "text", f"{path}.{key}[{j}]") if isinstance(part, dict) else "")
    return "".join(texts)


# The chat request's parameter names, as the Responses request calls them.
_PARAM_NAMES = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("structured_outputs", "text.format"),
)


def rename_param(exc: APIError) -> APIError:
    """An error from the chat path, its ``param`` named as the Responses request names it."""
    param = exc.param
    if not param:
        return exc
    for chat_name, name in _PARAM_NAMES:
        if (
            param == chat_name
            or param.startswith(chat_name + ".")
            or param.startswith(chat_name + "[")
        ):
            exc.param = name + param[len(chat_name) :]
            return exc
    if param.startswith("tools[") and ".function." in param:
        exc.param = param.replace(".function.", ".", 1)
    elif param.startswith("tool_choice.function."):
        exc.param = param.replace("tool_choice.function.", "tool_choice.", 1)
    return exc


# ---------------------------------------------------------------- chat output -> response
