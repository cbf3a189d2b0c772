"""Bad words: ban a sequence's last token when the output so far ends with the rest of it."""

from __future__ import annotations

from collections.abc import Sequence


def banned_tokens(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Token ids to ban at the next position, given the token sequences to avoid (the
    reference that ``BadWords`` answers as, word by word)."""
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


class BadWords:
    """One sequence's bad words, indexed so that a step costs what could match, not what was
    sent: a request's bad words (up to 512 sequences of up to 256 tokens each) were compared
    whole with the output at every step of every sample, 3.6-5.4 ms per sequence and step
    (n=128: a step of every request beside it 0.5 s longer).

    A word's prefix can only match when it ends with the output's last token: the words are
    looked up by that token, then per prefix length by the output's tail of that length (one
    slice and one hash lookup per length). ``banned`` answers as ``banned_tokens``, in the
    words' order."""

    __slots__ = ("_always", "_by_last")

    def __init__(self, bad_words: Sequence[Sequence[int]]) -> None:
        # (position, token): the words' order kept, as banned_tokens lists them
        self._always: list[tuple[int, int]] = []
        self._by_last: dict[int, dict[int, dict[tuple[int, ...], list[tuple[int, int]]]]] = {}
        for position, words in enumerate(bad_words):
            if not words:
                continue
            if len(words) == 1:
                self._always.append((position, words[0]))
                continue
            prefix = tuple(words[:-1])
            by_len = self._by_last.setdefault(prefix[-1], {})
            by_len.setdefault(len(prefix), {}).setdefault(prefix, []).append((position, words[-1]))

    def banned(self, output: Sequence[int]) -> list[int]:
        """Token ids to ban at the next position, after ``output``."""
        found = list(self._always)
        by_len = self._by_last.get(output[-1]) if output else None
        if by_len:
            size = len(output)
            for length, prefixes in by_len.items():
                if length <= size:
                    found += prefixes.get(tuple(output[size - length :]), ())
            if len(found) > len(self._always):
                found.sort()
        return [token for _, token in found]
