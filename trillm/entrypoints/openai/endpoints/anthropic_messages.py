"""POST /v1/messages and POST /v1/messages/count_tokens (Anthropic's Messages API) on the chat
path.

A Messages request is turned into the chat request it means (``anthropic_convert.py``), run by
the chat pipeline (``endpoints/chat.start_chat``: the same rendering, checks, budgets, tool and
reasoning parsing), and its output told as an Anthropic message (``anthropic_output.py``:
``thinking`` (with --reasoning-parser), ``text`` and ``tool_use`` blocks) or as Anthropic's
event stream (``anthropic_stream.py``). count_tokens counts the ids chat's stage 2 gives the
same request (``chat.prompt_tokens``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import trio

from trillm.entrypoints.openai.endpoints.anthropic_convert import to_chat_request
from trillm.entrypoints.openai.endpoints.anthropic_output import message_body
from trillm.entrypoints.openai.endpoints.anthropic_stream import MessageStream
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.chat import prompt_tokens, start_chat
from trillm.entrypoints.openai.endpoints.chat_parsing import plan_tools
from trillm.entrypoints.openai.endpoints.generation import guard_stream
from trillm.entrypoints.openai.http.errors import from_engine_exception
from trillm.entrypoints.openai.schemas.anthropic import CountTokensRequest, MessagesRequest
from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest

# Requests of more messages and content blocks than this are converted on a worker thread:
# a few microseconds a block, and on the event loop that is every other request's wait.
CONVERT_OFF_LOOP_BLOCKS = 2_000


async def create_message(
    state: ServerState, req: MessagesRequest
) -> dict[str, Any] | AsyncIterator[bytes]:
    chat = await _chat_request(state, req, f"msg_{uuid.uuid4().hex}")
    answer, gen = await start_chat(state, chat)
    if req.stream:
        return guard_stream(gen, MessageStream(answer).events(gen))
    return message_body(await answer.full(gen))


async def count_tokens(state: ServerState, req: CountTokensRequest) -> dict[str, Any]:
    """``{"input_tokens": N}``: the prompt's tokens as /v1/messages would send them."""
    state.check_model(req.model)
    chat = await _chat_request(state, req, "")
    tools = plan_tools(state, chat)
    try:
        ids, _, _ = await prompt_tokens(state, chat, tools)
    except ValueError as exc:  # the preprocessor's refusals name their field: 400
        raise from_engine_exception(exc) from exc
    return {"input_tokens": len(ids)}


async def _chat_request(
    state: ServerState, req: CountTokensRequest, request_id: str
) -> ChatCompletionRequest:
    takes_images = state.preprocessor.multimodal is not None
    if _size(req) < CONVERT_OFF_LOOP_BLOCKS:
        return to_chat_request(req, request_id, takes_images)
    return await trio.to_thread.run_sync(to_chat_request, req, request_id, takes_images)


def _size(req: CountTokensRequest) -> int:
    """Messages and content blocks of ``req``, counted up to CONVERT_OFF_LOOP_BLOCKS."""
    size = len(req.messages)
    for message in req.messages:
        if size >= CONVERT_OFF_LOOP_BLOCKS:
            break
        content = message.get("content") if isinstance(message, dict) else None
        size += len(content) if isinstance(content, list) else 0
    return size
