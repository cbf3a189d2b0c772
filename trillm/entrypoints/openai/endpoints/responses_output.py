"""The Responses API's output objects: the response body (``ResponseBuilder``, from a chat
completion's result) and its items and content parts, shared by the whole-body answer
(``serving_responses``) and the event stream (``responses_stream``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.schemas.responses import ResponsesRequest


class ResponseBuilder:
    """The Response object: its fixed fields (the request's, echoed) and its output items."""

    def __init__(
        self,
        state: ServerState,
        req: ResponsesRequest,
        response_id: str,
        on_finished: Callable[[dict[str, Any]], object] | None = None,
    ) -> None:
        self.state = state
        self.req = req
        self.id = response_id
        self.created_at = int(time.time())
        # Given the finished body (completed or incomplete): the store's keep, when stored.
        self.on_finished = on_finished

    def finished(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.on_finished is not None:
            self.on_finished(body)
        return body

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        req = self.req
        incomplete = None
        if finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif finish_reason in ("abort", "timeout"):
            status, incomplete = "incomplete", {"reason": finish_reason}
        fmt = req.text.format if req.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.state.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": None,
            },
            "service_tier": "default",
            "store": self.on_finished is not None,
            "temperature": req.temperature,
            "text": {"format": _format_json(fmt)},
            "tool_choice": _tool_choice_json(req),
            "tools": [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "strict": t.strict,
                }
                for t in req.tools or []
            ],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
            "background": bool(req.background),
        }

    def usage(
        self, chat_usage: dict[str, Any], reasoning_text: str, cache: tuple[int, int]
    ) -> dict[str, Any]:
        """``cache``: the prompt tokens read from the prefix cache and those computed and
        written to it (RequestTracker.cache_totals), vLLM's cached / cache_write_tokens."""
        # NOTE: the reasoning's token count is its text re-tokenized: the parser splits text,
        # not token ids (the count can differ by a token at the boundary).
        reasoning_tokens = (
            len(self.state.tokenizer.encode(reasoning_text, add_special_tokens=False))
            if reasoning_text
            else 0
        )
        return {
            "input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cache[0], "cache_write_tokens": cache[1]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"],
        }

    def from_chat(self, chat: dict[str, Any], cache: tuple[int, int]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or ""
        if reasoning:
            output.append(reasoning_item(new_id("rs"), reasoning, "completed"))
        if message.get("content"):
            output.append(message_item(new_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            output.append(
                function_call_item(
                    new_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"
                )
            )
        usage = self.usage(chat["usage"], reasoning, cache)
        return self.finished(self.body("completed", output, usage, choice["finish_reason"]))


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [reasoning_part(text)]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _format_json(fmt: Any) -> dict[str, Any]:
    if fmt is None:
        return {"type": "text"}
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return {
        "type": "json_schema",
        "name": fmt.name or "response",
        "schema": fmt.schema,
        "description": fmt.description,
        "strict": fmt.strict,
    }


def _tool_choice_json(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    if isinstance(choice, str):
        return choice
    return {"type": "function", "name": choice.name}
