"""A pooling model's requests on the Trio engine (``AsyncEngine.encode`` / ``classify``): the
prompt prepared with pooling parameters, run as one request whose final output carries the
vector (the last stage's pooler, ``trillm/model_executor/pooling.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt, PromptType
from trillm.errors import RequestFailedError
from trillm.outputs import EmbeddingOutput, PoolingRequestOutput, RequestOutput, pooling_params

if TYPE_CHECKING:
    from trillm.config import TrillmConfig
    from trillm.engine.preprocess import Preprocessor
    from trillm.engine.request_stream import RequestStream
    from trillm.sampling_params import SamplingParams


class PoolingEngine(Protocol):
    """What ``pool`` uses of ``AsyncEngine``, which imports this module (so its class is not
    named here: that would close an import cycle)."""

    @property
    def config(self) -> TrillmConfig: ...

    @property
    def preprocessor(self) -> Preprocessor: ...

    @property
    def is_pooling(self) -> bool: ...

    def generate(
        self,
        prompt: PromptType | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        _pooling: bool = False,
    ) -> RequestStream: ...


async def pool(
    engine: PoolingEngine,
    prompt: PromptType | PreparedPrompt,
    request_id: str | None,
    truncate_prompt_tokens: int | None,
    priority: int,
    task: str,  # "embed" or "classify": what the caller asked for
) -> PoolingRequestOutput:
    """InvalidRequestError (a 400) unless the engine pools with ``task``."""
    if not engine.is_pooling:
        raise InvalidRequestError(
            "This model generates text: start it with runner='pooling' (or "
            "convert='embed') to embed prompts.",
            "model",
        )
    own = engine.config.pooler.task if engine.config.pooler is not None else "embed"
    if own != task:
        raise InvalidRequestError(
            f"This pooling model's task is {own!r} ("
            + (
                "classify / LLM.classify / /classify"
                if own == "classify"
                else "embed / LLM.embed / /v1/embeddings"
            )
            + f"), not {task!r}.",
            "model",
        )
    prepared: PreparedPrompt = (
        prompt
        if isinstance(prompt, PreparedPrompt)
        else await engine.preprocessor.prepare(
            prompt, pooling_params(truncate_prompt_tokens), priority=priority
        )
    )
    final: RequestOutput | None = None
    async with engine.generate(prepared, request_id=request_id, _pooling=True) as outputs:
        async for out in outputs:
            final = out
    if final is None or final.pooled is None:  # aborted (a worker refused it, a shutdown)
        raise RequestFailedError(f"Pooling request {request_id} ended without its vector.")
    vector = np.frombuffer(final.pooled, dtype=np.float32).tolist()
    if final.metrics is not None and final.outputs:  # --collect-detailed-traces (a copy)
        c = final.outputs[0]
        final.metrics.model_forward_time = c.model_forward_time
        final.metrics.model_execute_time = c.model_execute_time
    return PoolingRequestOutput(
        final.request_id,
        list(prepared.prompt_token_ids),
        EmbeddingOutput(vector),
        metrics=final.metrics,
    )
