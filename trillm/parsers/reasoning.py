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
- glm45, step3, kimi_k2, mistral, hunyuan_a13b, granite: ``reasoning_families.py``.

``extract`` splits a finished output; ``streamer()`` splits it delta by delta, holding back a
possibly partial tag, and the deltas add up to ``extract``'s result.

The engine side (structured outputs wait for the end of reasoning, as in vLLM):
``token_ids(tokenizer)`` gives the tags' token ids (refused when they are not single tokens)
and ``prompt_state(prompt_ids, ids)`` says where an output starts: in reasoning, after it
(the prompt closed it: Qwen3 with ``enable_thinking: false``), or, for qwen3 with no tag in the
prompt, undecided until the first token (``<think>`` or content).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from trillm.parsers import harmony
from trillm.parsers.tool_parsers.base import held_prefix

START = "<think>"
END = "</think>"

# Where an output starts (``ReasoningParser.prompt_state``).
ENDED = "ended"  # after the reasoning: constrained from its first token
REASONING = "reasoning"  # inside it: unconstrained until </think>
UNDECIDED = "undecided"  # its first token is <think> (then reasoning) or content


class ReasoningParser:
    name: ClassVar[str] = ""
    # Where an output starts when its prompt holds neither tag (``prompt_state``).
    untagged_prompt_state: ClassVar[str] = REASONING
    # Whether the engine can hold a grammar back until the reasoning ends (one end token).
    structured_outputs: ClassVar[bool] = True
    start_tag: ClassVar[str] = START
    end_tag: ClassVar[str] = END
    # Text that ends the reasoning as ``end_tag`` does but belongs to the content (Kimi K2's
    # tool-call section, which may follow reasoning without an end tag).
    content_tags: ClassVar[tuple[str, ...]] = ()

    def __init__(self, prompt: str = "", chat_template_kwargs: dict[str, Any] | None = None):
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs or {}

    def starts_in_reasoning(self) -> bool:
        """Whether an output that does not begin with ``<think>`` begins in reasoning."""
        raise NotImplementedError

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``; before the end, a possibly partial tag is held."""
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag) :]
        elif not final and self.start_tag.startswith(body):
            return "", ""  # nothing yet, or the start of <think>
        elif not self.starts_in_reasoning():
            return "", text
        found = self.reasoning_end(body)
        if found is not None:
            return body[: found[0]], body[found[1] :]
        if not final:
            body = body[: len(body) - self.held_end(body)]
        return body, ""

    def reasoning_end(self, text: str) -> tuple[int, int] | None:
        """(where the reasoning in ``text`` ends, where the content starts), or None."""
        end = text.find(self.end_tag)
        found = (end, end + len(self.end_tag)) if end >= 0 else None
        for tag in self.content_tags:
            at = text.find(tag)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, at)
        return found

    def held_end(self, text: str) -> int:
        """Length of the end of ``text`` that may begin what ends the reasoning."""
        return max(held_prefix(text, tag) for tag in (self.end_tag, *self.content_tags))

    def extract(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self.split(text, True)
        return reasoning or None, content or None

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)

    # ------------------------------------------------------------ engine side (token ids)

    @classmethod
    def token_ids(cls, tokenizer: Any) -> tuple[int, int]:
        """(``<think>`` id, ``</think>`` id) in ``tokenizer``; ValueError naming the parser when
        either is not one token (the engine could not see where reasoning ends)."""
        vocab = tokenizer.get_vocab()
        tags = cls.start_tag, cls.end_tag
        ids = vocab.get(tags[0]), vocab.get(tags[1])
        if ids[0] is None or ids[1] is None:
            missing = " and ".join(t for t, i in zip(tags, ids) if i is None)
            raise ValueError(
                f"Reasoning parser {cls.name!r} needs {tags[0]} and {tags[1]} as single tokens of the "
                f"tokenizer (structured outputs start where reasoning ends); this tokenizer has "
                f"no {missing} token."
            )
        return ids[0], ids[1]

    @classmethod
    def prompt_state(cls, prompt_ids: Any, ids: tuple[int, int]) -> str:
        """Where the output of ``prompt_ids`` starts: the prompt's last tag decides (a
        rendered ``<think>\\n\\n</think>`` has ended reasoning, an open ``<think>`` has not)."""
        start, end = ids
        for token in reversed(prompt_ids):
            if token == end:
                return ENDED
            if token == start:
                return REASONING
        return cls.untagged_prompt_state


class ReasoningStreamer:
    """``feed(delta)`` / ``finish()`` -> ``(reasoning_delta, content_delta)``, the same split
    as ``ReasoningParser.split`` at a cost of each delta's length (reasoning runs long)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.state = "start"  # then "reasoning" or "content"
        self.held = ""  # the start of the output (undecided), or a possibly partial </think>

    def feed(self, delta: str) -> tuple[str, str]:
        if self.state == "content":
            return "", delta
        if self.state == "reasoning":
            return self._reasoning(delta)
        self.held += delta
        body = self.held.lstrip()
        start = self.parser.start_tag
        if body.startswith(start):
            body = body[len(start) :]
        elif start.startswith(body):
            return "", ""  # nothing yet, or the start of <think>
        elif not self.parser.starts_in_reasoning():
            self.state = "content"
            text, self.held = self.held, ""
            return "", text
        self.state, self.held = "reasoning", ""
        return self._reasoning(body)

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "start":
            return self.parser.split(held, True)
        return (held, "") if self.state == "reasoning" else ("", "")

    def _reasoning(self, delta: str) -> tuple[str, str]:
        text = self.held + delta
        found = self.parser.reasoning_end(text)
        if found is not None:
            self.state, self.held = "content", ""
            return text[: found[0]], text[found[1] :]
        keep = self.parser.held_end(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""


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


class ContentStreamer(ReasoningStreamer):
    """Every delta is content."""

    def feed(self, delta: str) -> tuple[str, str]:
        return "", delta

    def finish(self) -> tuple[str, str]:
        return "", ""


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    untagged_prompt_state = UNDECIDED

    def starts_in_reasoning(self) -> bool:
        at = self.prompt.rfind(START)
        return at >= 0 and self.prompt.find(END, at) < 0


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
    def token_ids(cls, tokenizer: Any) -> tuple[int, int]:
        return -1, -1  # no single tokens (structured outputs are refused instead)

    @classmethod
    def prompt_state(cls, prompt_ids: Any, ids: tuple[int, int]) -> str:
        return REASONING


class ResplitStreamer(ReasoningStreamer):
    """The whole text split again after each delta, the growth of each part sent: for
    parsers whose ``split`` of a text is a prefix of the split of any longer text."""

    def __init__(self, parser: ReasoningParser) -> None:
        super().__init__(parser)
        self.text = ""
        self.sent = ("", "")

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._grown(False)

    def finish(self) -> tuple[str, str]:
        return self._grown(True)

    def _grown(self, final: bool) -> tuple[str, str]:
        parts = self.parser.split(self.text, final)
        grown = tuple(
            now[len(sent) :] if now.startswith(sent) else ""
            for now, sent in zip(parts, self.sent, strict=True)
        )
        self.sent = parts
        return grown[0], grown[1]


_REGISTRY: dict[str, type[ReasoningParser]] = {
    p.name: p
    for p in (
        DeepSeekR1ReasoningParser,
        DeepSeekV3ReasoningParser,
        Qwen3ReasoningParser,
        GptOssReasoningParser,
    )
}
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


# The other families' parsers register themselves (they build on the classes above).
from trillm.parsers import reasoning_families  # noqa: E402, F401
