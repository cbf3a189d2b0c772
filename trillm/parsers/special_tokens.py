"""Which parser markers are special tokens of a tokenizer: those vanish from text decoded
with ``skip_special_tokens`` (the default), so a request parsed for them must keep them
(vLLM's adjust_request). Shared by the HTTP chat path and ``LLM.chat``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trillm.parsers import harmony

# The think tags (Magistral's, and Kimi K2's tool-call section, which ends its reasoning too),
# and harmony's (gpt-oss): its channels are told apart by special tokens only.
REASONING_MARKERS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "[THINK]",
    "[/THINK]",
    "<|tool_calls_section_begin|>",
)
REASONING_MARKERS += harmony.SPECIAL


def markers_are_special(tokenizer: Any, markers: Sequence[str], reasoning: bool = False) -> bool:
    """Whether any of ``markers`` (plus the think tags when ``reasoning``) is special."""
    wanted = set(markers) | (set(REASONING_MARKERS) if reasoning else set())
    return bool(wanted) and not _special_tokens(tokenizer).isdisjoint(wanted)


_SPECIAL: dict[int, tuple[Any, frozenset[str]]] = {}  # id -> (tokenizer, its special tokens)


def _special_tokens(tokenizer: Any) -> frozenset[str]:
    cached = _SPECIAL.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    names = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            names.add(str(token.content))
    _SPECIAL[id(tokenizer)] = (tokenizer, frozenset(names))
    return frozenset(names)
