"""The Responses API's store (``VLLM_ENABLE_RESPONSES_API_STORE=1``, vLLM's): a response asked
with ``store`` (true by default, as in OpenAI's API) is kept once finished, with the chat
messages it answered, so that ``GET /v1/responses/{id}`` returns it and a later request's
``previous_response_id`` continues its conversation (as vLLM builds it: that request's
messages less their system ones, each ``output_text`` of the response as an assistant
message, then the new input; instructions do not carry over).

Unlike vLLM's (which never forgets), the store is bounded, so that one client cannot grow the
server's memory without end: at most ``MAX_ENTRIES`` responses and ``MAX_BYTES`` of them
(their JSON plus their messages' text, estimated), the least recently stored or used going
first; a response larger than the whole budget is not kept. Without the variable ``store`` is
ignored (vLLM's: the response says ``"store": false``), and a ``previous_response_id`` is
never found (404).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs
import orjson

from trillm.entrypoints.openai.http.errors import NotFoundError
from trillm.entrypoints.openai.schemas.protocol import ChatMessage

MAX_ENTRIES = 4096
MAX_BYTES = 256 * 1024 * 1024
# Counted for each message on top of its text (its role, ids, the list it sits in).
MESSAGE_OVERHEAD = 64


@attrs.define
class Stored:
    response: dict[str, Any]
    messages: list[ChatMessage]  # the chat messages the response answered
    nbytes: int


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def keep(self, response: dict[str, Any], messages: list[ChatMessage]) -> bool:
        """Store ``response`` (a finished one) and its messages; False when it alone is larger
        than the store (then it is not kept)."""
        size = len(orjson.dumps(response)) + sum(_message_bytes(m) for m in messages)
        self._drop(response["id"])
        if size > self.max_bytes:
            return False
        while self._items and (
            len(self._items) >= self.max_entries or self.nbytes + size > self.max_bytes
        ):
            self._drop(next(iter(self._items)))
        self._items[response["id"]] = Stored(response, messages, size)
        self.nbytes += size
        return True

    def get(self, response_id: str) -> Stored:
        """The stored response (now the most recently used), or vLLM's 404."""
        found = self._items.get(response_id)
        if found is None:
            raise not_found(response_id)
        self._items.move_to_end(response_id)
        return found

    def _drop(self, response_id: str) -> None:
        gone = self._items.pop(response_id, None)
        if gone is not None:
            self.nbytes -= gone.nbytes


def not_found(response_id: str) -> NotFoundError:
    shown = response_id if len(response_id) <= 256 else response_id[:256] + "..."
    return NotFoundError(f"Response with id '{shown}' not found.", "response_id")


def history(stored: Stored) -> list[ChatMessage]:
    """The messages a request continuing ``stored`` starts with (vLLM's rule: the previous
    messages but the system ones, then each output_text of its output as an assistant
    message; reasoning and function calls of the output are left out, as in vLLM)."""
    messages = [m for m in stored.messages if m.role != "system"]
    for item in stored.response["output"]:
        if item.get("type") != "message":
            continue
        for part in item.get("content") or []:
            if part.get("type") == "output_text":
                messages.append(ChatMessage(role="assistant", content=part["text"]))
    return messages


def _message_bytes(message: ChatMessage) -> int:
    size = MESSAGE_OVERHEAD + _utf8(message.reasoning_content)
    content = message.content
    if isinstance(content, str):
        size += _utf8(content)
    elif content is not None:
        size += sum(_utf8(getattr(p, "text", None)) + MESSAGE_OVERHEAD for p in content)
    for call in message.tool_calls or []:
        args = call.function.arguments
        size += MESSAGE_OVERHEAD + _utf8(call.function.name)
        size += _utf8(args) if isinstance(args, str) else len(orjson.dumps(args))
    return size


def _utf8(text: str | None) -> int:
    return len(text.encode()) if text else 0
