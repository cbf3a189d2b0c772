"""Reasoning parsers of more model families (vLLM's names; ``reasoning_base.py`` has the
think-tag machinery, ``reasoning.py`` the registry these join):

- ``qwen3``: described in ``reasoning.py``.
- ``glm45``: GLM-4.5 / 4.6 / 4.7, ``<think>...</think>`` as ``qwen3`` reads it (reasoning when
  the output begins with ``<think>`` or the prompt ends inside an open one).
- ``step3``: Step3, whose template opens the reasoning in the prompt: everything before
  ``</think>`` is reasoning (all of it when ``</think>`` never comes).
- ``kimi_k2``: Kimi K2 (thinking), reasoning until ``</think>`` or until the tool-call
  section begins (which belongs to the content); with the request's ``chat_template_kwargs``
  ``thinking: false`` the whole output is content.
- ``mistral``: Magistral's ``[THINK]...[/THINK]`` special tokens; text outside them is
  content (no ``[THINK]``: all content, a stray ``[/THINK]`` dropped).
- ``hunyuan_a13b``: Hunyuan-A13B's ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>``:
  the answer is the content (its closing tag and what follows dropped).
- ``granite``: Granite 3.2's plain-text sections, ``Here is my thought process:`` (or
  ``Here's``) then ``Here is my response:``.

An output cut off while reasoning is reasoning for all of them, streamed or not. The last
three end their reasoning at text the engine cannot wait for as one token (several tokens, or
text that is not special): structured outputs are refused with them, and they are streamed by
splitting the whole text again after each delta (``ResplitStreamer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from trillm.parsers.reasoning_base import (
    END,
    REASONING,
    START,
    UNDECIDED,
    ContentStreamer,
    ReasoningParser,
    ReasoningStreamer,
    ResplitStreamer,
)
from trillm.parsers.tool_parsers.base import held_prefix

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    untagged_prompt_state = UNDECIDED
    text_tags = True

    @property
    def thinking(self) -> bool:
        return bool(self.chat_template_kwargs.get("enable_thinking", True))

    def starts_in_reasoning(self) -> bool:
        if not self.tags_are_tokens:
            # vLLM 0.32 on a tokenizer without the tags (e.g. SmolLM2): the output starts in
            # reasoning unless chat_template_kwargs' enable_thinking is false.
            return self.thinking
        at = self.prompt.rfind(START)
        return at >= 0 and self.prompt.find(END, at) < 0

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if not self.tags_are_tokens and not self.thinking:
            return "", text  # (vLLM 0.32: no tag is read then, the whole output is content)
        return super().split(text, final)

    def streamer(self) -> ReasoningStreamer:
        if not self.tags_are_tokens and not self.thinking:
            return ContentStreamer(self)
        return super().streamer()


class Glm45ReasoningParser(Qwen3ReasoningParser):
    name = "glm45"
    text_tags = False


class Step3ReasoningParser(ReasoningParser):
    name = "step3"

    def starts_in_reasoning(self) -> bool:
        return True


class KimiK2ReasoningParser(ReasoningParser):
    name = "kimi_k2"
    content_tags = ("<|tool_calls_section_begin|>",)

    @property
    def thinking(self) -> bool:
        return bool(self.chat_template_kwargs.get("thinking", True))

    def starts_in_reasoning(self) -> bool:
        return True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return super().split(text, final) if self.thinking else ("", text)

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self) if self.thinking else ContentStreamer(self)


class _ResplitParser(ReasoningParser):
    """A parser whose reasoning ends at text the engine cannot wait for as one token."""

    structured_outputs = False

    def streamer(self) -> ReasoningStreamer:
        return ResplitStreamer(self)

    @classmethod
    def token_ids(cls, tokenizer: Tokenizer) -> tuple[int, int]:
        return -1, -1  # not single tokens (structured outputs are refused instead)

    @classmethod
    def prompt_state(cls, prompt_ids: Sequence[int], ids: tuple[int, int]) -> str:
        return REASONING


class MistralReasoningParser(ReasoningParser):
    """The think tags are special tokens: the engine waits for ``[/THINK]``; an output that
    does not begin with ``[THINK]`` is content from its first token on."""

    name = "mistral"
    start_tag = "[THINK]"
    end_tag = "[/THINK]"
    untagged_prompt_state = UNDECIDED

    def starts_in_reasoning(self) -> bool:
        return False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        before, start, after = text.partition(self.start_tag)
        if start:
            reasoning, end, rest = after.partition(self.end_tag)
            if end:
                return reasoning, before + rest
            return (
                after if final else after[: len(after) - held_prefix(after, self.end_tag)]
            ), before
        if not final:
            held = max(held_prefix(text, self.start_tag), held_prefix(text, self.end_tag))
            text = text[: len(text) - held]
        return "", "".join(text.partition(self.end_tag)[::2])

    def streamer(self) -> ReasoningStreamer:
        return ResplitStreamer(self)


class HunyuanA13BReasoningParser(_ResplitParser):
    name = "hunyuan_a13b"
    start_tag = "<think>\n"
    end_tag = "\n</think>\n<answer>\n"
    ANSWER_END: ClassVar[str] = "\n</answer>"

    def starts_in_reasoning(self) -> bool:
        return False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = super().split(text, final)
        answer, end, _ = content.partition(self.ANSWER_END)
        if not end and not final:
            answer = answer[: len(answer) - held_prefix(answer, self.ANSWER_END)]
        return reasoning, answer


class GraniteReasoningParser(_ResplitParser):
    name = "granite"
    STARTS: ClassVar[tuple[str, ...]] = (
        "Here is my thought process:",
        "Here's my thought process:",
    )
    ENDS: ClassVar[tuple[str, ...]] = ("Here is my response:", "Here's my response:")
    thinking_budget = False  # two spellings of each phrase: no one tag to count or force

    def starts_in_reasoning(self) -> bool:
        return False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        start = next((s for s in self.STARTS if text.startswith(s)), None)
        if start is None:
            undecided = not final and any(s.startswith(text) for s in self.STARTS)
            return "", "" if undecided else text
        body = text[len(start) :]
        ends = [(body.find(e), e) for e in self.ENDS if e in body]
        if ends:
            at, end = min(ends)
            return body[:at], body[at + len(end) :]
        if not final:
            body = body[: len(body) - max(held_prefix(body, e) for e in self.ENDS)]
        return body, ""


FAMILIES: tuple[type[ReasoningParser], ...] = (
    Qwen3ReasoningParser,
    Glm45ReasoningParser,
    Step3ReasoningParser,
    KimiK2ReasoningParser,
    MistralReasoningParser,
    HunyuanA13BReasoningParser,
    GraniteReasoningParser,
)
