"""The SSE events of a streamed /v1/responses request (OpenAI's typed events).

Order, as OpenAI sends them: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done`` (a reasoning item likewise with ``response.reasoning_text.*``;
a function call with ``response.function_call_arguments.delta`` / ``.done``), then
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` when
max_output_tokens cut the output). Every event has a ``sequence_number`` counting from 0.
An error after the stream started is an ``error`` event; no ``[DONE]`` (OpenAI sends none).

Items come from the chat parser's deltas (``ChoiceParser.feed``): reasoning, content and tool
call fragments, in the order the model wrote them; a new kind of delta closes the open item.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from trillm.entrypoints.openai.endpoints.chat_output import ChatAnswer
from trillm.entrypoints.openai.endpoints.generation import Generation, raise_if_error
from trillm.entrypoints.openai.endpoints.responses_output import (
    ResponseBuilder,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    reasoning_part,
    text_part,
)
from trillm.entrypoints.openai.http.errors import APIError


class _Item:
    """The output item being streamed: its kind, id, place and text so far."""

    __slots__ = ("kind", "id", "index", "text", "call_id", "name")

    def __init__(self, kind: str, index: int, call_id: str = "", name: str = "") -> None:
        self.kind = kind  # "reasoning" | "message" | "function_call"
        self.id = new_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.index = index
        self.text = ""  # the reasoning, the message text or the call's arguments
        self.call_id = call_id
        self.name = name

    def json(self, status: str) -> dict[str, Any]:
        text = self.text if status == "completed" else None
        if self.kind == "reasoning":
            return reasoning_item(self.id, text, status)
        if self.kind == "message":
            return message_item(self.id, text, status)
        return function_call_item(self.id, self.call_id, self.name, self.text, status)


class ResponseStream:
    def __init__(self, built: ResponseBuilder, ctx: ChatAnswer) -> None:
        self.built = built
        self.ctx = ctx
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the finished items
        self.open: _Item | None = None
        self.reasoning = ""  # all reasoning text (usage's reasoning_tokens)

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    async def events(self, gen: Generation) -> AsyncIterator[bytes]:
        ctx = self.ctx
        start = self.built.body("in_progress", [], None)
        parts = [
            self.event("response.created", response=start),
            self.event("response.in_progress", response=start),
        ]
        parser = ctx.parser() if ctx.parser is not None else None
        finish_reason: str | None = None
        try:
            async for _, item in gen:
                out = raise_if_error(item)
                ctx.tracker.observe(out)
                for c in out.outputs:
                    final = c.finish_reason is not None
                    delta = parser.feed(c.text, final) if parser else {"content": c.text}
                    self._delta(delta, parts)
                    if final:
                        reason = parser.finish_reason(c.finish_reason) if parser else None
                        finish_reason = reason or str(c.finish_reason)
                if parts and not out.finished:
                    yield b"".join(parts)
                    parts = []
            if finish_reason is None:  # the channel closed first: the server aborted it
                if parser is not None:
                    self._delta(parser.feed("", True), parts)
                finish_reason = "abort"
            self._close(parts)
            tracker = ctx.tracker
            usage = self.built.usage(tracker.usage(), self.reasoning, tracker.cache_totals())
            body = self.built.finished(
                self.built.body("completed", self.output, usage, finish_reason)
            )
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            parts.append(self.event(kind, response=body))
            yield b"".join(parts)
        except APIError as err:
            error = err.body()["error"]
            parts.append(
                self.event(
                    "error", code=str(error["code"]), message=error["message"], param=error["param"]
                )
            )
            yield b"".join(parts)
        finally:
            await gen.aclose()
            ctx.tracker.finish(1)

    # ------------------------------------------------------------ items

    def _delta(self, delta: dict[str, Any], parts: list[bytes]) -> None:
        reasoning = delta.get("reasoning_content")
        if reasoning:
            self._text("reasoning", reasoning, parts)
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call: its header (id, name), then argument fragments
                self._open(_Item("function_call", len(self.output), call["id"], fn["name"]), parts)
            args = fn.get("arguments") or ""
            item = self.open
            if args and item is not None and item.kind == "function_call":
                item.text += args
                parts.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=item.index,
                        delta=args,
                    )
                )
        content = delta.get("content")
        if content:
            self._text("message", content, parts)

    def _text(self, kind: str, text: str, parts: list[bytes]) -> None:
        item = self.open
        if item is None or item.kind != kind:
            item = _Item(kind, len(self.output))
            self._open(item, parts)
        item.text += text
        if kind == "reasoning":
            self.reasoning += text
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        parts.append(
            self.event(
                name, item_id=item.id, output_index=item.index, content_index=0, delta=text, **extra
            )
        )

    def _open(self, item: _Item, parts: list[bytes]) -> None:
        self._close(parts)
        item.index = len(self.output)
        self.open = item
        parts.append(
            self.event(
                "response.output_item.added", output_index=item.index, item=item.json("in_progress")
            )
        )
        if item.kind != "function_call":
            part = text_part("") if item.kind == "message" else reasoning_part("")
            parts.append(
                self.event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=item.index,
                    content_index=0,
                    part=part,
                )
            )

    def _close(self, parts: list[bytes]) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            parts.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=item.text,
                )
            )
        else:
            if item.kind == "message":
                parts.append(
                    self.event(
                        "response.output_text.done",
                        **where,
                        content_index=0,
                        text=item.text,
                        logprobs=[],
                    )
                )
                part = text_part(item.text)
            else:
                parts.append(
                    self.event(
                        "response.reasoning_text.done", **where, content_index=0, text=item.text
                    )
                )
                part = reasoning_part(item.text)
            parts.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        done = item.json("completed")
        self.output.append(done)
        parts.append(self.event("response.output_item.done", output_index=item.index, item=done))
