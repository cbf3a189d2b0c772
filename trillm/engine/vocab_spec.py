"""Stage 10: the detokenizer's token -> bytes table, read once from a tokenizer.

``build_vocab_spec`` reads a ``tokenizers`` tokenizer's decoder and vocabulary into a
``VocabSpec`` (plain data) when the decoder is one of the two pipelines the detokenizer models
exactly (``DecoderScheme``: ``BYTE_LEVEL``, GPT-2 style; ``BYTE_FALLBACK``, SentencePiece
style, ``Metaspace`` included), else None. The detokenizers built on it, native and Python
twin, and the choice between them are in ``detokenizer.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer

    from trillm.tokenizer_protocol import Tokenizer

_BYTE_TOKEN_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class DecoderScheme(enum.IntEnum):
    BYTE_LEVEL = 0
    BYTE_FALLBACK = 1


@dataclass(frozen=True, slots=True)
class VocabSpec:
    """Everything the detokenizer needs from a tokenizer, as plain data."""

    table: list[bytes]  # [vocab] token id -> its bytes (a byte token: the single byte)
    special_ids: list[int]  # dropped when skip_special_tokens
    scheme: DecoderScheme
    byte_token_ids: list[int]  # BYTE_FALLBACK only: ids of the <0xNN> tokens
    strip_leading_spaces: int  # BYTE_FALLBACK only: leading ' ' stripped from the whole text
    # BYTE_FALLBACK only: what a token decodes to when it is the first one ([] = as ``table``)
    first_table: list[bytes] = dataclasses.field(default_factory=list)


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to
    code points 256 + n in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def backend_tokenizer(tokenizer: Tokenizer | BackendTokenizer) -> BackendTokenizer:
    """The ``tokenizers.Tokenizer`` behind a transformers tokenizer (or the object itself)."""
    from tokenizers import Tokenizer as Backend

    if isinstance(tokenizer, Backend):
        return tokenizer
    # A fast tokenizer's backend (no member of ``Tokenizer``: a slow one has none).
    for attr in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, attr, None)
        if isinstance(backend, Backend):
            return backend
    raise TypeError(f"{type(tokenizer).__name__} is not backed by a `tokenizers` tokenizer.")


def build_vocab_spec(tokenizer: Tokenizer | BackendTokenizer) -> VocabSpec | None:
    """The table for ``tokenizer``, or None when its decoder is not one we model exactly."""
    backend = backend_tokenizer(tokenizer)
    config = json.loads(backend.to_str())
    if _needs_cleanup(tokenizer, config):
        return None  # transformers would rewrite spaces around punctuation afterwards
    decoder = config.get("decoder") or {}
    tokens = _token_strings(backend)
    special_ids = sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    if decoder.get("type") == "ByteLevel":
        table = _byte_level_table(tokens)
        return VocabSpec(table, special_ids, DecoderScheme.BYTE_LEVEL, [], 0)
    if decoder.get("type") == "Metaspace":
        return _metaspace_spec(decoder, tokens, special_ids)
    steps = _byte_fallback_steps(decoder)
    if steps is None:
        return None
    replace, byte_fallback, strip = steps
    table, byte_ids = _byte_fallback_table(tokens, replace, byte_fallback)
    return VocabSpec(table, special_ids, DecoderScheme.BYTE_FALLBACK, byte_ids, strip)


def _metaspace_spec(
    decoder: dict[str, Any], tokens: list[str], special_ids: list[int]
) -> VocabSpec | None:
    # tokenizers' Metaspace decoder: '▁' -> ' ', except in the first token, where every '▁'
    # is dropped (unless prepend_scheme is "never").
    if decoder.get("replacement", "▁") != "▁":
        return None
    table = [t.replace("▁", " ").encode("utf-8") for t in tokens]
    first_table: list[bytes] = []
    if decoder.get("prepend_scheme", "always") != "never":
        first_table = [t.replace("▁", "").encode("utf-8") for t in tokens]
    return VocabSpec(table, special_ids, DecoderScheme.BYTE_FALLBACK, [], 0, first_table)


def _needs_cleanup(tokenizer: Tokenizer | BackendTokenizer, config: dict[str, Any]) -> bool:
    from tokenizers import Tokenizer as Backend

    # transformers 5 ignores clean_up_tokenization_spaces for BPE models (see its _decode);
    # a bare ``tokenizers`` tokenizer never cleans up.
    if isinstance(tokenizer, Backend) or not tokenizer.clean_up_tokenization_spaces:
        return False
    return (config.get("model") or {}).get("type") != "BPE"


def _token_strings(backend: BackendTokenizer) -> list[str]:
    size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    return [backend.id_to_token(i) or "" for i in range(size)]


def _byte_level_table(tokens: list[str]) -> list[bytes]:
    # NOTE: like tokenizers' ByteLevel decoder, a token whose characters are not all in the
    # byte alphabet (an added token such as "ab日") contributes its own UTF-8 bytes.
    to_byte = _gpt2_unicode_to_byte()
    table = []
    for token in tokens:
        mapped = [to_byte.get(ch) for ch in token]
        if all(b is not None for b in mapped):
            table.append(bytes(mapped))  # type: ignore[arg-type]
        else:
            table.append(token.encode("utf-8"))
    return table


def _byte_fallback_steps(decoder: dict[str, Any]) -> tuple[bool, bool, int] | None:
    """(replace '▁', byte fallback, strip count) if ``decoder`` is a SentencePiece pipeline."""
    if decoder.get("type") != "Sequence":
        return None
    order = ["Replace", "ByteFallback", "Fuse", "Strip"]
    names = [d.get("type") for d in decoder.get("decoders", [])]
    if any(n not in order for n in names) or names != sorted(names, key=order.index):
        return None
    if len(set(names)) != len(names):
        return None
    found = {d["type"]: d for d in decoder["decoders"]}
    replace = found.get("Replace")
    if replace is not None and (
        replace.get("pattern") != {"String": "▁"} or replace["content"] != " "
    ):
        return None
    strip = found.get("Strip")
    if strip is not None and (strip["content"] != " " or strip["stop"] != 0 or "Fuse" not in found):
        return None  # without Fuse first, Strip would apply to every token
    strip_count = int(strip["start"]) if strip is not None else 0
    return replace is not None, "ByteFallback" in found, strip_count


def _byte_fallback_table(
    tokens: list[str], replace: bool, byte_fallback: bool
) -> tuple[list[bytes], list[int]]:
    table: list[bytes] = []
    byte_ids: list[int] = []
    for i, token in enumerate(tokens):
        match = _BYTE_TOKEN_RE.match(token) if byte_fallback else None
        if match is not None:
            table.append(bytes([int(match.group(1), 16)]))
            byte_ids.append(i)
        else:
            text = token.replace("▁", " ") if replace else token
            table.append(text.encode("utf-8"))
    return table, byte_ids
