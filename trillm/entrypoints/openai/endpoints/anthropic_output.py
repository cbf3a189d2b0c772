"""The Anthropic Messages API's answer: the message body (from a chat completion's result) and
the pieces the event stream (``anthropic_stream.py``) shares with it: content blocks, the stop
reason and the usage."""

from __future__ import annotations

import json
from typing import Any

# Chat's finish reasons as Anthropic's stop reasons; "stop" is "end_turn", "stop_sequence" or
# "tool_use" (see ``stop_reason``). An output the server cut short (abort, timeout) has none.
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(
    finish_reason: str | None, matched: int | str | None, tool_used: bool
) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for chat's ``finish_reason`` and ``stop_reason`` (the stop
    string matched, a stop token id, or None for EOS); ``tool_used``: a tool_use block was
    written (a named tool choice finishes with "stop", as on chat)."""
    if finish_reason in _STOP_REASONS:
        return _STOP_REASONS[finish_reason], None
    if finish_reason != "stop":
        return None, None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return ("tool_use" if tool_used else "end_turn"), None


def usage(chat_usage: dict[str, Any]) -> dict[str, int]:
    """vLLM's Anthropic usage from a chat usage. With --enable-prompt-tokens-details (chat's
    ``prompt_tokens_details``), the prompt tokens read from the prefix cache are
    ``cache_read_input_tokens`` and not in ``input_tokens`` (Anthropic's total input is their
    sum), and those it computed and wrote there are ``cache_creation_input_tokens``, not in
    ``input_tokens`` either; without it the cache is not reported and ``input_tokens`` is the
    whole prompt."""
    counts = {
        "input_tokens": chat_usage["prompt_tokens"],
        "output_tokens": chat_usage["completion_tokens"],
    }
    details = chat_usage.get("prompt_tokens_details")
    if details is not None and details.get("cached_tokens") is not None:
        read = details["cached_tokens"]
        counts["input_tokens"] = max(0, counts["input_tokens"] - read)
        counts["cache_read_input_tokens"] = read
    if details is not None and details.get("created_cache_tokens") is not None:
        written = details["created_cache_tokens"]
        counts["input_tokens"] = max(0, counts["input_tokens"] - written)
        counts["cache_creation_input_tokens"] = written
    return counts


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, Any]:
    # NOTE: no signature: the reasoning comes from this server's model, nothing signs it.
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call_id: str, name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def message_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's JSON body (one choice) as an Anthropic message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append(thinking_block(message["reasoning_content"]))
    if message.get("content"):
        content.append(text_block(message["content"]))
    tool_used = False
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        tool_input = _arguments(fn["arguments"])
        if tool_input is None:  # cut short by max_tokens: not a call, the text it wrote
            content.append(text_block(fn["arguments"]))
            continue
        content.append(tool_use_block(call["id"], fn["name"], tool_input))
        tool_used = True
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), tool_used)
    return {
        "id": chat["id"],
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat["usage"]),
    }


def _arguments(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the tool_use block's input object; None unless a JSON object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
