"""The tool-parser contract and the machinery every parser shares (scanning JSON output is
``json_scan``).

A parser only answers one question: how does the model's output text ``text`` (all of it when
``final``, what has come so far otherwise) split into content and calls (``split``)? The rest
follows from that answer, the same way for every parser:

- non-streamed: ``extract`` joins the content pieces and lists the calls;
- streamed: ``ToolCallStreamer`` splits the text after each delta and sends what grew:
  content, then for each call its header (``index``, ``id``, ``type``, ``name``) once the name
  is known, then argument fragments. A parser that implements ``split_tail`` is split only
  from the end of its last complete call on (a ``Resume`` point), so a stream costs time
  linear in its length; other parsers are split from the start after every delta.

For a streamed call the arguments so far must be a prefix of its final arguments, so parsers
give the arguments as the model wrote them (the raw JSON text of the value) where they can,
and hold back what is not decided yet (a partial start tag, a call whose name has not come).
Whitespace around calls is not content, in both modes alike.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class CallPiece:
    name: str | None  # None: the call has started, its name has not come yet
    arguments: str = ""  # JSON text; while streaming, a prefix of the final arguments
    complete: bool = False
    call_id: str | None = None  # the model's own id for the call (Kimi K2's), else made up


@dataclass(frozen=True)
class Resume:
    """A point of the text where a streamed split goes on from: just after a complete call
    (or content that can no longer change). Nothing before it can change whatever text
    follows, so it is split once."""

    pos: int  # in the text ``split_tail`` was given
    pieces: int  # how many of the pieces ``split_tail`` returned lie before ``pos``
    state: str  # the parser's own: which part of its format ``pos`` is in ("": the start)
    after_call: bool = True  # the piece before ``pos`` is a call


@dataclass
class ToolCall:
    """A parsed call in OpenAI's shape (``to_dict``)."""

    name: str
    arguments: str
    id: str = ""
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


class ToolParser:
    """Subclass, set ``name``, implement ``split``; register with ``register_tool_parser``.

    Optional hints that make long plain outputs cheap to stream: ``markers``, strings that
    begin every call (text without any is all content); ``start_only``, calls come only at
    the start of the output (once ``split`` gives the whole text back as content, it stays
    content)."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    start_only: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []  # the request's tools, as the template saw them

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        raise NotImplementedError

    def split_tail(
        self, text: str, final: bool, state: str
    ) -> tuple[list[str | CallPiece], Resume | None] | None:
        """``split`` of the text that follows a ``Resume`` point with this ``state`` ("": the
        whole text), and the last ``Resume`` point in it (None: none yet). None when the text
        shows the output is not what ``state`` assumed (a malformed call list, which makes the
        whole output content): the caller then splits the whole text.

        The default resumes nowhere: the whole text is split every time."""
        return None if state else (self.split(text, final), None)

    def make_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls = assemble(self.split(text, True), True)
        tool_calls = [
            ToolCall(c.name, c.arguments or "{}", c.call_id or self.make_id())
            for c in calls
            if c.name
        ]
        return ExtractedToolCalls(content or None, tool_calls)

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self)


class CallListParser(ToolParser):
    """A parser whose calls follow one another (a JSON list, ``;``-joined objects, a Python
    list): it splits the whole text with ``_split`` and, after a ``Resume`` point, reads only
    the calls that follow with ``_calls_after``, so a stream costs time linear in its length."""

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        return self._split(text, final)[0]

    def split_tail(
        self, text: str, final: bool, state: str
    ) -> tuple[list[str | CallPiece], Resume | None] | None:
        if not state:
            return self._split(text, final)
        found = self._calls_after(text, final, state)
        return None if found is None else (list(found[0]), found[1])

    def _split(self, text: str, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        """The whole text's pieces and the last Resume point in it."""
        raise NotImplementedError

    def _calls_after(
        self, text: str, final: bool, state: str
    ) -> tuple[Sequence[str | CallPiece], Resume | None] | None:
        """The calls of ``text``, which follows a whole call (before its separator; with any
        text after the calls), and the last Resume point; None when it shows the output is not
        a call list after all."""
        raise NotImplementedError


def mistral_id() -> str:
    """Mistral's templates check that call ids are 9 letters or digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def assemble(
    pieces: list[str | CallPiece], final: bool, after_call: bool = False
) -> tuple[str, list[CallPiece]]:
    """Content and calls from ``split``'s pieces: text beside a call loses the whitespace on
    that side; before the end, trailing whitespace is held back (a call may follow it).
    ``after_call``: the pieces follow a call (they come from ``split_tail`` after a Resume)."""
    content: list[str] = []
    calls: list[CallPiece] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, CallPiece):
            calls.append(piece)
            continue
        if isinstance(pieces[i - 1], CallPiece) if i > 0 else after_call:
            piece = piece.lstrip()
        last = i == len(pieces) - 1
        if (not last and isinstance(pieces[i + 1], CallPiece)) or (last and not final):
            piece = piece.rstrip()
        content.append(piece)
    return "".join(content), calls


class ToolCallStreamer:
    """Turns text deltas into OpenAI stream deltas: ``feed`` / ``finish`` return
    ``(content_delta, tool_call_deltas)``.

    While the output is plain text (no marker of ``parser.markers`` yet, or a start-only
    format that is content for good) each delta costs its own length: only the text after
    what was sent (held whitespace, a partial marker) is kept. Otherwise the text after the
    last ``Resume`` point (the end of the last complete call) is split again: what comes
    before it was split and sent for good."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # the text after the Resume point
        self.sent_content = ""  # the content sent for that text
        self.ids: list[str] = []  # one per call whose header went out
        self.sent_args: list[str] = []
        # Before the Resume point: the text and the content sent for it (in pieces: joined
        # only if the output turns out malformed), how many calls, and the parser's state.
        self._head: list[str] = []
        self._head_content: list[str] = []
        self._head_calls = 0
        self._state = ""
        self._after_call = False
        # Plain mode: the text is content until a marker comes (None: split every delta).
        self._markers: tuple[str, ...] | None = parser.markers or None
        self._chunks: list[str] = []  # the text, while plain
        self._pending = ""  # its part not sent yet
        self._window = ""  # its last characters, to find a marker split across deltas

    @property
    def tools_called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if self._markers is not None:
            window = self._window + delta
            if not any(m in window for m in self._markers):
                self._chunks.append(delta)
                self._window = window[-max((len(m) for m in self._markers), default=1) :]
                return self._plain(delta), []
            self._leave_plain()
        self.text += delta
        if not self.ids and self.parser.start_only and not self.text.isspace():
            pieces = self.parser.split(self.text, False)
            if pieces == [self.text]:  # a start-only format that did not start: content
                self._markers, self._chunks = (), [self.text]
                self._pending, self.text = self.text[len(self.sent_content) :], ""
                return self._plain(""), []
        return self._diff(False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._markers is not None:
            rest, self._pending = self._pending, ""
            return rest, []
        return self._diff(True)

    def _plain(self, delta: str) -> str:
        text = self._pending + delta
        end = len(text) - max((held_prefix(text, m) for m in self._markers or ()), default=0)
        while end > 0 and text[end - 1].isspace():
            end -= 1  # a call may follow: held until more text comes
        self._pending = text[end:]
        return text[:end]

    def _leave_plain(self) -> None:
        self.text = "".join(self._chunks)
        self.sent_content = self.text[: len(self.text) - len(self._pending)]
        self._markers, self._chunks, self._pending, self._window = None, [], "", ""

    def _split(self, final: bool) -> tuple[list[str | CallPiece], Resume | None]:
        split = self.parser.split_tail(self.text, final, self._state)
        if split is None:  # malformed after all: split the whole text from the start
            self.text = "".join([*self._head, self.text])
            self.sent_content = "".join([*self._head_content, self.sent_content])
            self._head, self._head_content, self._head_calls, self._state = [], [], 0, ""
            self._after_call = False
            split = self.parser.split_tail(self.text, final, "")
            assert split is not None, "a split from the start always answers"
        return split

    def _diff(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        pieces, resume = self._split(final)
        after_call = self._after_call
        content, calls = assemble(pieces, final, after_call)
        content_delta = ""
        # NOTE: a split that contradicts what was sent (only for output that turned malformed
        # after a call was announced) sends nothing more rather than something inconsistent.
        if content.startswith(self.sent_content):
            content_delta = content[len(self.sent_content) :]
            self.sent_content = content
        deltas = self._call_deltas(calls, final)
        if resume is not None:
            self._advance(pieces[: resume.pieces], resume, after_call)
        return content_delta, deltas

    def _advance(self, settled: list[str | CallPiece], resume: Resume, after_call: bool) -> None:
        """Moves the Resume point past ``settled`` (pieces that can no longer change), when
        all of it went out as it is."""
        content, calls = assemble(settled, True, after_call)
        head_calls = self._head_calls + len(calls)
        if not self.sent_content.startswith(content) or len(self.ids) < head_calls:
            return  # not all sent (a contradicted split): keep splitting from here
        self._head.append(self.text[: resume.pos])
        self._head_content.append(content)
        self.text = self.text[resume.pos :]
        self.sent_content = self.sent_content[len(content) :]
        self._head_calls, self._state = head_calls, resume.state
        self._after_call = resume.after_call

    def _call_deltas(self, calls: list[CallPiece], final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls, self._head_calls):
            if index == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(call.call_id or self.parser.make_id())
                self.sent_args.append("")
                deltas.append(
                    {
                        "index": index,
                        "id": self.ids[index],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            args = call.arguments or ("{}" if final and call.complete else "")
            sent = self.sent_args[index]
            if len(args) > len(sent) and args.startswith(sent):
                deltas.append({"index": index, "function": {"arguments": args[len(sent) :]}})
                self.sent_args[index] = args
        return deltas


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
