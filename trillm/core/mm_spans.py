"""Prefill chunks that never end inside an image's placeholder span, for models whose image
tokens attend to each other both ways (Gemma 3): a token of the span needs the keys of the
span's later tokens, so the whole rest of a span is computed in one step.

A chunk that would end inside a span ends at the span's start instead; one that starts at (or,
after a prefix-cache hit, inside) a span and cannot take the rest of it this step takes nothing
and waits for a step with the budget (``--max-num-batched-tokens`` is checked at start to hold
a whole image). Both scheduler twins keep spans whole (``keep_mm_spans_whole``; the native
one's copy of ``clamp_to_spans`` is in ext/scheduler.pyx); the engine turns it on for such a
model (``engine_cores.make_scheduler``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trillm.config import TrillmConfig


def clamp_to_spans(num_computed: int, n: int, spans: list[tuple[int, int]]) -> int:
    """``n`` tokens from ``num_computed``, cut so that the chunk does not end inside a span."""
    end = num_computed + n
    for start, stop in spans:
        if start < end < stop:
            return max(0, start - num_computed)
    return n


def whole_span_tokens(config: TrillmConfig) -> int:
    """The longest span a step must hold whole (0: the model needs none)."""
    from trillm.model_executor.multimodal_config import bidirectional_image_tokens

    mm_config = config.model.mm_config
    if mm_config is None or not config.limit_mm_per_prompt.get("image"):
        return 0
    return bidirectional_image_tokens(mm_config)


def check_budget(config: TrillmConfig, span: int) -> None:
    """A step must be able to hold one whole image's tokens."""
    budget = config.scheduler.max_num_batched_tokens
    threshold = config.scheduler.long_prefill_token_threshold
    for name, value in (
        ("max_num_batched_tokens", budget),
        ("long_prefill_token_threshold", threshold),
    ):
        if 0 < value < span:
            raise ValueError(
                f"{name}={value} is less than an image's {span} tokens, which this model "
                "computes in one step (its image tokens attend to each other both ways)."
            )
