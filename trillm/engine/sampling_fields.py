"""The sampling fields stage 2 derives from the tokenizer (``Preprocessor.prepare_ids``): the
stop ids a request ends on, and the token ids of its bad words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trillm.sampling_params import SamplingParams

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
