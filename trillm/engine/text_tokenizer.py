"""Prompt text to token ids in stage 2 without stalling the event loop: the longest text that
could fit the context (refused before any work past it), and long texts tokenized in a few
threads (``Preprocessor.tokenize`` uses both)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

# NOTE: the text one token can stand for is at most its vocabulary entry (byte-level BPE
# entries spell one character per byte; SentencePiece and WordPiece entries spell their text,
# plus markers), so a prompt longer than max_model_len x the longest entry cannot fit. The x2
# covers pre-tokenizers that drop a separator between tokens (BERT's whitespace split); only
# texts mostly made of characters a tokenizer deletes (long whitespace runs for such
# tokenizers, control characters) could fit yet be refused. The floor of 32 keeps the bound
# generous for character-level vocabularies.
_MIN_CHARS_PER_TOKEN = 32
_SAFETY_FACTOR = 2
INLINE_TOKENIZE_CHARS = 20_000  # shorter texts are tokenized on the event loop
LARGE_TOKENIZE_CHARS = 1_000_000  # longer ones are tokenized one at a time


def max_text_chars(tokenizer: Tokenizer, max_model_len: int) -> int:
    """The longest text (in characters) that could tokenize to at most max_model_len tokens."""
    added = (str(t) for t in tokenizer.added_tokens_decoder.values())
    longest = max(map(len, [*tokenizer.get_vocab(), *added]), default=1)
    return max_model_len * max(longest, _MIN_CHARS_PER_TOKEN) * _SAFETY_FACTOR


class TokenizeThreads:
    """Where a text is tokenized: short ones inline, long ones in threads. Each thread can take
    many times its text's size in memory (~150 bytes a character for a fast tokenizer), so only
    a few run at once (the rest wait their turn), and texts of LARGE_TOKENIZE_CHARS and more
    (hundreds of MB of working memory) one at a time."""

    def __init__(self) -> None:
        # also bounds the other per-request CPU work of stage 2 (renders, media decoding)
        self.limiter = trio.CapacityLimiter(max(1, min(4, os.cpu_count() or 1)))
        self.large_limiter = trio.CapacityLimiter(1)

    async def encode(
        self, encode: Callable[..., list[int]], text: str, add_special_tokens: bool
    ) -> list[int]:
        if len(text) < INLINE_TOKENIZE_CHARS:
            return list(encode(text, add_special_tokens=add_special_tokens))

        def work() -> list[int]:
            return list(encode(text, add_special_tokens=add_special_tokens))

        if len(text) < LARGE_TOKENIZE_CHARS:
            return await trio.to_thread.run_sync(work, limiter=self.limiter)
        async with self.large_limiter:
            return await trio.to_thread.run_sync(work, limiter=self.limiter)
