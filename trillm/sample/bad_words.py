"""Bad words: ban a sequence's last token when the output so far ends with the rest of it."""

from __future__ import annotations

from collections.abc import Sequence


def banned_tokens(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Token ids to ban at the next position, given the token sequences to avoid."""
    banned = []
    for words in bad_words:
        if not words:
            continue
        prefix_len = len(words) - 1
        if prefix_len == 0 or (
            prefix_len <= len(output) and list(output[-prefix_len:]) == list(words[:-1])
        ):
            banned.append(words[-1])
    return banned
