"""Hermes-style calls, as Qwen2.5 / Qwen3 (and Hermes 2/3) write them::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Text outside the tags is content. A block that is not a call object stays content, tags and
all (the model wrote something else); an unclosed block at the end (cut by max_tokens) is a
call when its object is complete.
"""

from __future__ import annotations

from trillm.parsers.tool_parsers.base import CallPiece
from trillm.parsers.tool_parsers.json_scan import json_call
from trillm.parsers.tool_parsers.tagged import TaggedBlockParser


class HermesToolParser(TaggedBlockParser):
    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    markers = (START,)

    def _calls(self, body: str, final: bool, closed: bool) -> list[CallPiece] | None:
        # One call object a block (what follows it in the block is ignored).
        call, _ = json_call(body, 0, final or closed)
        if call is None:
            return None
        if final:  # cut off before the closing tag, but the object is whole
            call.complete = True
        return [call]


class InternLMToolParser(HermesToolParser):
    """InternLM2 / 2.5's calls (vLLM's ``internlm``): Hermes' call object (``parameters`` or
    ``arguments``) in InternLM's plugin action tags::

        Let me check.<|action_start|><|plugin|>
        {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>
    """

    name = "internlm"
    START = "<|action_start|><|plugin|>"
    END = "<|action_end|>"
    # One special token of the tokenizer (the server keeps special tokens for the parser).
    markers = ("<|action_start|>",)
