"""The sampling fields stage 2 derives from the tokenizer (``Preprocessor.prepare_ids``): the
stop ids a request ends on, the token ids of its bad words, and the reasoning tags a
``thinking_token_budget`` counts between."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trillm.sampling_params import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer


def apply_stop_ids(
    params: SamplingParams, eos_token_id: int | None, extra_eos_ids: list[int]
) -> None:
    """``stop_token_ids``: the request's own plus generation_config's further EOS ids (unless
    it ignores EOS); ``all_stop_token_ids``: those and the EOS, which ``min_tokens`` holds
    back."""
    stop_ids = list(params.stop_token_ids or [])
    if not params.ignore_eos:
        stop_ids += [t for t in extra_eos_ids if t not in stop_ids]
    params.stop_token_ids = stop_ids
    eos = [eos_token_id] if eos_token_id is not None else []
    params.all_stop_token_ids = sorted(set(stop_ids + eos))


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        # A word can appear at the start of the text or after a space: ban both spellings.
        for variant in (word, " " + word.lstrip()):
            ids = list(tokenizer.encode(variant, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


@dataclass(frozen=True, slots=True)
class ThinkingTags:
    """What ``thinking_token_budget`` needs, found once per engine: the reasoning parser's
    [start tag ids, end tag ids], or why a budget is refused."""

    ids: list[list[int]] | None
    refusal: str | None = None

    def apply(self, params: SamplingParams) -> None:
        """Gives a budgeted request the tag ids; SamplingParamsError when refused."""
        if params.thinking_token_budget is None:
            return
        if self.refusal is not None:
            raise SamplingParamsError("thinking_token_budget", self.refusal)
        params.thinking_tag_ids = self.ids


def thinking_tags(
    tokenizer: Tokenizer, reasoning_parser: str | None, speculative: bool
) -> ThinkingTags:
    """The tags as vLLM finds them: the parser's start and end strings, tokenized."""
    if reasoning_parser is None:
        return ThinkingTags(
            None,
            "thinking_token_budget needs a reasoning parser (--reasoning-parser, or the "
            "engine's reasoning_parser): the budget counts the tokens inside its reasoning tags.",
        )
    from trillm.parsers.reasoning import get_reasoning_parser

    parser = get_reasoning_parser(reasoning_parser)
    if not parser.thinking_budget:
        return ThinkingTags(
            None,
            f"thinking_token_budget is not supported with the {parser.name} reasoning parser "
            "(its reasoning does not end at one fixed tag to force).",
        )
    if speculative:
        return ThinkingTags(
            None, "thinking_token_budget is not supported with speculative decoding."
        )
    tags = [list(tokenizer.encode(t, add_special_tokens=False)) for t in parser.budget_tags()]
    return ThinkingTags(tags)
