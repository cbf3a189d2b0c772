"""Reasoning parsers (``--reasoning-parser NAME``): the ``<think>...</think>`` section of an
output becomes ``reasoning_content`` (and vLLM's newer ``reasoning``), the rest ``content``.

- ``deepseek_r1``: the output starts in reasoning (R1's template opens ``<think>`` in the
  prompt; a ``<think>`` the model writes itself is dropped); everything before ``</think>`` is
  reasoning, and all of it when ``</think>`` never comes (cut off while thinking).
- ``deepseek_v3``: DeepSeek-V3.1 / V3.2's hybrid thinking: ``deepseek_r1`` when the request's
  ``chat_template_kwargs`` has ``thinking: true``, else the whole output is content.
- ``qwen3``: the output starts in reasoning when it begins with ``<think>`` or the rendered
  prompt ends inside an open ``<think>`` (Qwen3.5 / thinking-2507 templates); otherwise it is
  all content (``enable_thinking: false`` renders a closed ``<think></think>`` in the prompt).
- ``openai_gptoss`` (also ``gpt_oss``): gpt-oss's harmony channels, analysis as reasoning
  (``GptOssReasoningParser`` below).
- qwen3 (above), glm45, step3, kimi_k2, mistral, hunyuan_a13b, granite:
  ``reasoning_families.py``; the machinery they share: ``reasoning_base.py``.

``extract`` splits a finished output; ``streamer()`` splits it delta by delta, holding back a
possibly partial tag, and the deltas add up to ``extract``'s result.

The engine side (structured outputs wait for the end of reasoning, as in vLLM):
``token_ids(tokenizer)`` gives the tags' token ids (refused when they are not single tokens)
and ``prompt_state(prompt_ids, ids)`` says where an output starts: in reasoning, after it
(the prompt closed it: Qwen3 with ``enable_thinking: false``), or, for qwen3 with no tag in the
prompt, undecided until the first token (``<think>`` or content).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trillm.parsers import harmony
from trillm.parsers.reasoning_base import (
    END,
    ENDED,
    REASONING,
    START,
    UNDECIDED,
    ContentStreamer,
    ReasoningParser,
    ReasoningStreamer,
    ResplitStreamer,
)
from trillm.parsers.reasoning_families import (
    FAMILIES,
    Qwen3ReasoningParser,
)

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

__all__ = [
    "ENDED",
    "REASONING",
    "UNDECIDED",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStreamer",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self) -> bool:
        # In reasoning unless the prompt closed it (then the engine constrains from the first
        # token: the output is all content).
        return self.prompt.rfind(END) <= self.prompt.rfind(START)


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    """DeepSeek-V3.1 / V3.2, thinking or not by the request's ``chat_template_kwargs``
    ``thinking`` (their template's switch): with it, R1's split; without it, the whole output
    is content, tags and all (vLLM's identity parser). The engine side reads the prompt's
    last tag, which these templates render (``<think>`` or ``</think>``); untagged: content."""

    name = "deepseek_v3"
    untagged_prompt_state = ENDED

    @property
    def thinking(self) -> bool:
        return bool(self.chat_template_kwargs.get("thinking", False))

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return super().split(text, final) if self.thinking else ("", text)

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self) if self.thinking else ContentStreamer(self)


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony channels (``parsers/harmony.py``): the ``analysis`` messages are the
    reasoning (joined by newlines); ``final`` and recipient-less ``commentary`` messages (the
    model's preambles) are the content; a message to a tool stays in the content as the model
    wrote it, where the ``openai`` tool parser finds it. Streamed by splitting the whole text
    again after each delta (``ResplitStreamer``). vLLM's name, and ``gpt_oss``."""

    name = "openai_gptoss"
    # NOTE: reasoning ends at a multi-token header (``<|channel|>final<|message|>``), which the
    # engine's grammar gate (one end token) cannot see: structured outputs are refused.
    structured_outputs = False
    thinking_budget = False  # (the same header: no fixed tag to force)

    def starts_in_reasoning(self) -> bool:
        return True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for item in harmony.parse(text, final):
            if isinstance(item, harmony.Loose):
                content.append(item.text)
            elif item.recipient is not None:
                content.append(item.raw)
            elif item.channel == harmony.ANALYSIS:
                reasoning.append(item.body)
            else:
                content.append(item.body)
        return "\n".join(reasoning), "".join(content)

    def streamer(self) -> ReasoningStreamer:
        return ResplitStreamer(self)

    @classmethod
    def token_ids(cls, tokenizer: Tokenizer) -> tuple[int, int]:
        return -1, -1  # no single tokens (structured outputs are refused instead)

    @classmethod
    def prompt_state(cls, prompt_ids: Sequence[int], ids: tuple[int, int]) -> str:
        return REASONING


_BUILT_IN: tuple[type[ReasoningParser], ...] = (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    GptOssReasoningParser,
    *FAMILIES,
)
_REGISTRY: dict[str, type[ReasoningParser]] = {p.name: p for p in _BUILT_IN}
_REGISTRY["gpt_oss"] = GptOssReasoningParser


def register_reasoning_parser(
    name: str,
) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _REGISTRY[name] = cls
        return cls

    return register


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; registered: {', '.join(sorted(_REGISTRY))}."
        ) from None


def reasoning_parser_names() -> list[str]:
    return sorted(_REGISTRY)
