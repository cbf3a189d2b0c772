"""Which parser markers are special tokens of a tokenizer: those vanish from text decoded
with ``skip_special_tokens`` (the default), so a request parsed for them must keep them
(vLLM's adjust_request). Shared by the HTTP chat path and ``LLM.chat``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trillm.parsers import harmony

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

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


def markers_are_special(
    tokenizer: Tokenizer, markers: Sequence[str], reasoning: bool = False
) -> bool:
    """Whether any of ``markers`` (plus the think tags when ``reasoning``) is special."""
    wanted = set(markers) | (set(REASONING_MARKERS) if reasoning else set())
    return bool(wanted) and not _special_tokens(tokenizer).isdisjoint(wanted)


# id -> (tokenizer, its special tokens)
_SPECIAL: dict[int, tuple[Tokenizer, frozenset[str]]] = {}


def _special_tokens(tokenizer: Tokenizer) -> frozenset[str]:
    cached = _SPECIAL.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    names = set(tokenizer.all_special_tokens)
    names.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    _SPECIAL[id(tokenizer)] = (tokenizer, frozenset(names))
    return frozenset(names)
