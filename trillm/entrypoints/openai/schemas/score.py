"""Request bodies of vLLM's ``/score`` (``/v1/score``) and ``/rerank`` (``/v1/rerank``,
``/v2/rerank``; Jina's and Cohere's shape). Limits are checked by ``structuring.structure``:
at most MAX_PROMPTS texts a side, each bounded by the context length before it is tokenized."""

from __future__ import annotations

from typing import Any, Union

import attrs

from trillm.entrypoints.openai.schemas.protocol import MAX_PROMPTS, _f


@attrs.define(kw_only=True)
class _ScoringFields:
    model: str | None = None
    truncate_prompt_tokens: int | None = _f(None, ge=-1)  # -1: the model's context length
    priority: int = 0
    # A cross-encoder's score through its activation (sigmoid) or, False, its raw logit;
    # ``activation`` and ``softmax`` are vLLM's older names.
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # refused: scoring takes text only


@attrs.define(kw_only=True)
class ScoreRequest(_ScoringFields):
    text_1: Union[str, list[str]] = _f(max_prompts=MAX_PROMPTS)  # noqa: UP007
    text_2: Union[str, list[str]] = _f(max_prompts=MAX_PROMPTS)  # noqa: UP007


@attrs.define(kw_only=True)
class RerankRequest(_ScoringFields):
    query: str
    documents: list[str] = _f(max_len=MAX_PROMPTS)
    top_n: int = 0  # 0 (or less): every document
    return_documents: bool = True  # Cohere's: False leaves each result's document out
