"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer's
configuration as its tokenizer_config.json states it (the tokenizer's init kwargs, less the
vocabulary and merges file paths), its class name, and the server's chat template."""

from __future__ import annotations

from typing import Any

from trillm.entrypoints.openai.endpoints.base import ServerState

_FILE_PATH_KEYS = ("vocab_file", "merges_file")


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    kwargs = dict(state.tokenizer.init_kwargs)
    for key in _FILE_PATH_KEYS:
        kwargs.pop(key, None)
    info: dict[str, Any] = {key: _plain(value) for key, value in kwargs.items()}
    info["tokenizer_class"] = type(state.tokenizer).__name__
    template = state.preprocessor.chat_template
    if template:
        info["chat_template"] = template
    return info


def _plain(value: object) -> object:
    """``value`` as JSON: a special token (``AddedToken``) as its text, as vLLM writes it;
    anything else JSON cannot hold as its ``str`` (never a 500 for one odd kwarg)."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
