"""Request bodies of the pooling endpoints: ``/v1/embeddings`` (OpenAI's shape plus vLLM's
extras), ``/pooling`` and ``/classify`` (vLLM's). Limits are checked by ``structuring.structure``."""

from __future__ import annotations

from typing import Literal, Union

import attrs

from trillm.entrypoints.openai.schemas.protocol import MAX_PROMPTS, _f


@attrs.define(kw_only=True)
class EmbeddingRequest:
    # One text, a list of texts, one prompt as token ids, or a list of those.
    input: Union[str, list[str], list[int], list[list[int]]] = _f(max_prompts=MAX_PROMPTS)  # noqa: UP007
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = _f(None, ge=1)
    truncate_prompt_tokens: int | None = _f(None, ge=-1)  # -1: the model's context length


@attrs.define(kw_only=True)
class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the same fields; the answer carries raw pooled ``data``."""


@attrs.define(kw_only=True)
class ClassificationRequest:
    """vLLM's /classify: class probabilities of a sequence classifier, one per input."""

    input: Union[str, list[str], list[int], list[list[int]]] = _f(max_prompts=MAX_PROMPTS)  # noqa: UP007
    model: str | None = None
    truncate_prompt_tokens: int | None = _f(None, ge=-1)  # -1: the model's context length
