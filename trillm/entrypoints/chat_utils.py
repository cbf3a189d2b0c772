"""Moved to ``trillm.engine.chat_template`` (stage 2 lives in the engine package); the names
stay importable here for the entrypoints that still use this path."""

from trillm.engine.chat_template import (
    ChatTemplateError,
    compile_template,
    content_text,
    load_chat_template,
    normalize_messages,
    normalize_tools,
    render_chat,
    render_template,
    tokenizer_chat_template,
    tokenizer_special_tokens,
)

__all__ = [
    "ChatTemplateError",
    "compile_template",
    "content_text",
    "load_chat_template",
    "normalize_messages",
    "normalize_tools",
    "render_chat",
    "render_template",
    "tokenizer_chat_template",
    "tokenizer_special_tokens",
]
