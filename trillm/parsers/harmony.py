"""The harmony format of gpt-oss outputs, read from text decoded with its special tokens kept.

The prompt ends with ``<|start|>assistant``; the model then writes messages::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A message is a header (the role, ``<|channel|>`` and its name, a recipient ``to=...`` before or
after the channel, a content type such as ``<|constrain|>json``) up to ``<|message|>``, then
its body up to ``<|end|>``, ``<|call|>`` or ``<|return|>`` (or the end of the output: a stop
token is not in the text). Text outside any message is ``Loose``.

``parse(text, final)``: before the end, a header that has not reached ``<|message|>`` is held
back (its channel and recipient may still change) and so is a possibly partial special token
at the end of a body; what it gives for a text is then a prefix of what it gives for any
longer text, so streams can send the difference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
SPECIAL = (START, CHANNEL, MESSAGE, CONSTRAIN, *TERMINATORS)
ANALYSIS, COMMENTARY, FINAL = "analysis", "commentary", "final"
FUNCTIONS = "functions."  # a recipient that names a function tool
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")


@dataclass
class Loose:
    text: str


@dataclass
class Message:
    raw_header: str  # from <|start|> or <|channel|> through <|message|>
    channel: str
    recipient: str | None
    body: str
    terminator: str | None  # None: the output ended (or, streaming, has not yet)

    @property
    def function(self) -> str | None:
        """The function tool this message calls, if it is a call."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS) :]
        return None

    @property
    def raw(self) -> str:
        return self.raw_header + self.body + (self.terminator or "")


def _held(text: str) -> int:
    """Length of the longest end of ``text`` that could begin a special token."""
    for k in range(min(len(text), max(len(s) for s in SPECIAL) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in SPECIAL):
            return k
    return 0


def _header(raw: str) -> tuple[str, str | None]:
    channel = _CHANNEL_NAME.search(raw)
    recipient = _RECIPIENT.search(raw)
    return (channel.group(1) if channel else ""), (recipient.group(1) if recipient else None)


def _next_start(text: str, pos: int) -> int:
    found = [i for i in (text.find(START, pos), text.find(CHANNEL, pos)) if i >= 0]
    return min(found) if found else -1


def parse(text: str, final: bool) -> list[Loose | Message]:
    items: list[Loose | Message] = []
    pos = 0
    while pos < len(text):
        start = _next_start(text, pos)
        if start < 0:
            loose = text[pos:]
            if not final:
                loose = loose[: len(loose) - _held(loose)]
            if loose:
                items.append(Loose(loose))
            break
        if start > pos:
            items.append(Loose(text[pos:start]))
        body_at = text.find(MESSAGE, start)
        if body_at < 0:  # the header goes on past the text
            if final:
                items.append(Loose(text[start:]))
            break
        raw_header = text[start : body_at + len(MESSAGE)]
        channel, recipient = _header(raw_header)
        ends = [(text.find(t, len(raw_header) + start), t) for t in TERMINATORS]
        found = [(i, t) for i, t in ends if i >= 0]
        if found:
            end, terminator = min(found)
            items.append(
                Message(
                    raw_header, channel, recipient, text[start + len(raw_header) : end], terminator
                )
            )
            pos = end + len(terminator)
            continue
        body = text[start + len(raw_header) :]
        if not final:
            body = body[: len(body) - _held(body)]
        items.append(Message(raw_header, channel, recipient, body, None))
        break
    return items
