"""Stage 10: stop strings, matched on the detokenized text across token boundaries.

The last ``max(len(stop)) - 1`` characters are held back from streaming (unless
``include_stop_str_in_output``) so a partial stop string is never sent and then retracted.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the earliest stop string that ends inside newly added text."""

    def __init__(self, stop: Sequence[str], include_in_output: bool) -> None:
        self.stop = list(stop)
        self.include_in_output = include_in_output
        # NOTE: a stop string may start up to len-1 characters before the new text, so that many
        # characters must not have been streamed yet; included stop strings are sent anyway.
        self.hold_back = 0 if include_in_output else max(len(s) for s in self.stop) - 1

    def find(self, text: str, new_from: int) -> tuple[str, int] | None:
        """(stop string, length to truncate ``text`` to) for a match ending after
        ``new_from``, or None."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        return stop, at + len(stop) if self.include_in_output else at
