"""The think-tag machinery every reasoning parser builds on (the parsers and their registry:
``reasoning.py``): a parser's ``split(text, final)`` into (reasoning, content), streamers that
send its growth delta by delta, and the engine side (``token_ids`` / ``prompt_state``: where
structured outputs start)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from trillm.parsers.tool_parsers.base import held_prefix

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

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
    # Whether ``thinking_token_budget`` can force the reasoning's end (``budget_tags``).
    thinking_budget: ClassVar[bool] = True
    start_tag: ClassVar[str] = START
    end_tag: ClassVar[str] = END
    # Text that ends the reasoning as ``end_tag`` does but belongs to the content (Kimi K2's
    # tool-call section, which may follow reasoning without an end tag).
    content_tags: ClassVar[tuple[str, ...]] = ()
    # Whether a tokenizer without the tags as single tokens is accepted (the tags then matched
    # in the text only, as vLLM 0.32's parser engine does for qwen3; structured outputs, which
    # wait for the end tag's id, are refused). Otherwise the engine start is refused.
    text_tags: ClassVar[bool] = False

    def __init__(
        self,
        prompt: str = "",
        chat_template_kwargs: dict[str, Any] | None = None,
        tags_are_tokens: bool = True,
    ):
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs or {}
        # False: the tokenizer has no single tokens for the tags (``text_tags`` parsers only)
        self.tags_are_tokens = tags_are_tokens

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
    def tags_are_tokens_of(cls, tokenizer: Tokenizer) -> bool:
        """Whether ``tokenizer`` has both tags as single tokens."""
        vocab = tokenizer.get_vocab()
        return cls.start_tag in vocab and cls.end_tag in vocab

    @classmethod
    def token_ids(cls, tokenizer: Tokenizer) -> tuple[int, int]:
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
    def budget_tags(cls) -> tuple[str, str]:
        """The texts ``thinking_token_budget`` counts between (and forces the second of)."""
        return cls.start_tag, cls.end_tag

    @classmethod
    def prompt_state(cls, prompt_ids: Sequence[int], ids: tuple[int, int]) -> str:
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


class ContentStreamer(ReasoningStreamer):
    """Every delta is content."""

    def feed(self, delta: str) -> tuple[str, str]:
        return "", delta

    def finish(self) -> tuple[str, str]:
        return "", ""


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
