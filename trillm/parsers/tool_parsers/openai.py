"""gpt-oss's harmony tool calls (vLLM's ``openai`` parser): a message whose recipient is
``functions.NAME`` is a call of NAME with the message's body as its arguments::

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

Every other message gives its body as content (with the ``openai_gptoss`` reasoning parser the
analysis messages are reasoning and never get here), and text outside messages is content as
it is. A call cut off before ``<|call|>`` is a call when the output ends. Split with
``parsers/harmony.py``, which holds back a header until ``<|message|>`` (the recipient is
known then) and a possibly partial special token at the end.
"""

from __future__ import annotations

from trillm.parsers import harmony
from trillm.parsers.tool_parsers.base import CallPiece, ToolParser


class OpenAIToolParser(ToolParser):
    name = "openai"
    markers = (harmony.START, harmony.CHANNEL)  # every message begins with one

    def split(self, text: str, final: bool) -> list[str | CallPiece]:
        pieces: list[str | CallPiece] = []
        for item in harmony.parse(text, final):
            if isinstance(item, harmony.Loose):
                pieces.append(item.text)
            elif item.function is not None:
                done = final or item.terminator is not None
                pieces.append(CallPiece(item.function, item.body, complete=done))
            else:
                pieces.append(item.body)
        return pieces
