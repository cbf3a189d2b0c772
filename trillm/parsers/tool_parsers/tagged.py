"""Formats whose calls sit in tagged blocks between stretches of content::

    Let me check.
    <START>...one or more calls...<END>
    <START>...<END>

Text outside the blocks is content. A closed block that does not read as calls stays content,
tags and all (the model wrote something else); an unclosed block at the end (cut by
max_tokens) is a call when its calls are whole. A stream is split from the end of its last
closed block of calls on (or of the content that ends the text; or, for formats with many calls
a block, of its last whole call), so it costs time linear in its length. Subclasses say what a block's body holds (``_calls``): hermes, internlm and jamba
(JSON), qwen3_coder, glm45 and minimax_m2 (XML-like tags).
"""

from __future__ import annotations

from typing import ClassVar

from trillm.parsers.tool_parsers.base import CallPiece, Resume, ToolParser, held_prefix


class TaggedBlockParser(ToolParser):
    START: ClassVar[str] = ""
    END: ClassVar[str] = ""

    def _calls(self, body: str, final: bool, closed: bool) -> list[CallPiece] | None:
        """The calls in a block's ``body``: all of it when ``closed`` (its end tag came) or
        ``final``, what has come so far otherwise (a last call may be partial, or nameless
        and left out). None when the body is not calls (known before the end, or at it)."""
        raise NotImplementedError

    def _block(
        self, body: str, final: bool, closed: bool, after_call: bool
    ) -> tuple[list[CallPiece], int, int] | None:
        """``_calls``, with where in ``body`` the last whole call ends and how many calls come
        before that (0, 0: nowhere to resume inside the block). ``after_call``: the body is
        what follows a whole call of its block (it may hold no more calls). A format with
        many calls a block overrides this, so a stream resumes after each of them."""
        calls = self._calls(body, final, closed)
        return None if calls is None else (calls, 0, 0)

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        split = self._split(text, final, False, False)
        assert split is not None, "a split from the start always answers"
        return split[0]

    def split_tail(
        self, text: str, final: bool, state: str
    ) -> tuple[list[str | CallPiece], Resume | None] | None:
        # The text after a block of calls (or after content) reads as a whole output; the
        # text after a call inside a block ("block") as that block's rest.
        return self._split(text, final, True, state == "block")

    def _split(
        self, text: str, final: bool, settle_text: bool, in_block: bool
    ) -> tuple[list[str | CallPiece], Resume | None] | None:
        """The pieces, and a Resume point after the last whole call or (``settle_text``)
        after the content that ends the text, but for what it holds back. ``in_block``: the
        text begins inside a block, after a whole call (None: the block is not calls)."""
        pieces: list[str | CallPiece] = []
        resume: Resume | None = None
        pos = 0
        pending = ""  # text of blocks that turned out not to be calls, joined with the next
        while True:
            if in_block:
                i = body_start = 0
            else:
                i = text.find(self.START, pos)
                if i < 0:
                    return self._tail(text, pos, final, settle_text, pieces, pending, resume)
                body_start = i + len(self.START)
            head: list[str | CallPiece] = [] if in_block else [pending + text[pos:i]]
            j = text.find(self.END, body_start)
            if j < 0:
                body = text[body_start:]
                found = self._block(
                    body if final else _unheld(body, self.END), final, False, in_block
                )
                if found is None and (final or in_block):
                    # not calls: all content (a block begun with calls: split it all again)
                    return None if in_block else ([*pieces, pending + text[pos:]], resume)
                calls, settled, before = found or ([], 0, 0)
                if settled:
                    resume = Resume(body_start + settled, len(pieces) + len(head) + before, "block")
                return [*pieces, *head, *calls], resume
            found = self._block(text[body_start:j], True, True, in_block)
            if found is None or not (found[0] or in_block):
                if in_block:
                    return None
                pending += text[pos : j + len(self.END)]
            else:
                pieces += [*head, *found[0]]
                pending = ""
                resume = Resume(j + len(self.END), len(pieces), "calls")
            pos, in_block = j + len(self.END), False

    def _tail(
        self,
        text: str,
        pos: int,
        final: bool,
        settle_text: bool,
        pieces: list[str | CallPiece],
        pending: str,
        resume: Resume | None,
    ) -> tuple[list[str | CallPiece], Resume | None]:
        """The content after the last block (``pos`` on)."""
        tail = text[pos:]
        if final:
            return [*pieces, pending + tail], resume
        tail = _unheld(tail, self.START)
        # NOTE: content up to its last non-space character stays as it is whatever follows:
        # a piece of its own, split once (a long text after a call).
        settled = len(tail.rstrip()) if settle_text else 0
        if settled == 0:
            return [*pieces, pending + tail], resume
        pieces = [*pieces, pending + tail[:settled], tail[settled:]]
        return pieces, Resume(pos + settled, len(pieces) - 1, "text", after_call=False)


def _unheld(text: str, tag: str) -> str:
    """``text`` without a possibly partial ``tag`` at its end."""
    return text[: len(text) - held_prefix(text, tag)]
