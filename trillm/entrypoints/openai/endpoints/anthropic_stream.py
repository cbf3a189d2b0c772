"""The SSE events of a streamed /v1/messages request, as Anthropic sends them.

Order: ``message_start`` (the message with no content, its input tokens counted), ``ping``;
per content block ``content_block_start``, ``content_block_delta``... (``text_delta``,
``thinking_delta`` or ``input_json_delta``), ``content_block_stop``; then ``message_delta``
(stop_reason, stop_sequence, the output tokens) and ``message_stop``. Each event is an
``event: NAME`` line and a ``data: JSON`` line. An error after the stream started is an
``error`` event, and the stream ends there.

Blocks come from the chat parser's deltas (``ChoiceParser.feed``): reasoning, content and tool
call fragments, in the order the model wrote them; a new kind of delta closes the open block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson

from trillm.entrypoints.openai.endpoints.anthropic_output import (
    stop_reason,
    text_block,
    thinking_block,
    tool_use_block,
    usage,
)
from trillm.entrypoints.openai.endpoints.chat_output import ChatAnswer
from trillm.entrypoints.openai.endpoints.generation import Generation, raise_if_error
from trillm.entrypoints.openai.http.errors import APIError, anthropic_error_body
from trillm.outputs import CompletionOutput

if TYPE_CHECKING:
    from trillm.entrypoints.openai.endpoints.chat_parsing import ChoiceParser

# The delta type of each block type's fragments, and the field that carries them.
_DELTAS = {
    "text": ("text_delta", "text"),
    "thinking": ("thinking_delta", "thinking"),
    "tool_use": ("input_json_delta", "partial_json"),
}


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class MessageStream:
    """One request's events, from its chat answer's outputs."""

    def __init__(self, answer: ChatAnswer) -> None:
        self.answer = answer
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # the open block's type
        self.tool_used = False

    async def events(self, gen: Generation) -> AsyncIterator[bytes]:
        answer = self.answer
        parts = [event("message_start", {"message": self._start()}), event("ping", {})]
        parser = answer.parser() if answer.parser is not None else None
        last: CompletionOutput | None = None
        try:
            async for _, item in gen:
                out = raise_if_error(item)
                answer.tracker.observe(out)
                for c in out.outputs:
                    final = c.finish_reason is not None
                    self._delta(
                        parser.feed(c.text, final) if parser else {"content": c.text}, parts
                    )
                    last = c if final else last
                if parts and not out.finished:
                    yield b"".join(parts)
                    parts = []
            if last is None and parser is not None:  # the server aborted it: the rest
                self._delta(parser.feed("", True), parts)
            self._close(parts)
            parts.append(self._end(last, parser))
            parts.append(event("message_stop", {}))
            yield b"".join(parts)
        except APIError as err:
            body = anthropic_error_body(err.message, err.status)
            yield b"".join(parts) + event("error", {"error": body["error"]})
        finally:
            await gen.aclose()
            answer.tracker.finish(1)

    def _start(self) -> dict[str, Any]:
        answer = self.answer
        return {
            "id": answer.request_id,
            "type": "message",
            "role": "assistant",
            "model": answer.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(answer.prompt_ids), "output_tokens": 0},
        }

    def _end(self, last: CompletionOutput | None, parser: ChoiceParser | None) -> bytes:
        finish = None if last is None else last.finish_reason
        if parser is not None and finish is not None:
            finish = parser.finish_reason(finish)
        matched = None if last is None else last.stop_reason
        reason, sequence = stop_reason(finish, matched, self.tool_used)
        # As vLLM's: the request's whole usage (input, output, the cache's share when reported)
        return event(
            "message_delta",
            {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(self.answer.tracker.usage()),
            },
        )

    # ------------------------------------------------------------ blocks

    def _delta(self, delta: dict[str, Any], parts: list[bytes]) -> None:
        reasoning = delta.get("reasoning_content")
        if reasoning:
            self._fragment("thinking", reasoning, parts)
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call: its block (id, name), then argument fragments
                self._open(tool_use_block(call["id"], fn["name"], {}), parts)
                self.tool_used = True
            args = fn.get("arguments") or ""
            if args and self.open == "tool_use":
                self._fragment("tool_use", args, parts)
        content = delta.get("content")
        if content:
            self._fragment("text", content, parts)

    def _fragment(self, kind: str, text: str, parts: list[bytes]) -> None:
        if self.open != kind:
            self._open(text_block("") if kind == "text" else thinking_block(""), parts)
        delta_type, field = _DELTAS[kind]
        parts.append(
            event(
                "content_block_delta",
                {"index": self.index, "delta": {"type": delta_type, field: text}},
            )
        )

    def _open(self, block: dict[str, Any], parts: list[bytes]) -> None:
        self._close(parts)
        self.index += 1
        self.open = block["type"]
        parts.append(event("content_block_start", {"index": self.index, "content_block": block}))

    def _close(self, parts: list[bytes]) -> None:
        if self.open is not None:
            parts.append(event("content_block_stop", {"index": self.index}))
            self.open = None
