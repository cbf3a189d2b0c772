"""POST /classify (vLLM's shape), for a sequence classifier (a ``*ForSequenceClassification``
checkpoint; ``model_executor/classification.py``). Each input is one engine request, prepared
and admitted as for ``/v1/embeddings`` (``serving_embedding``); the answer gives each input's
class probabilities and its most likely label (the checkpoint's ``id2label``)."""

from __future__ import annotations

import time
from typing import Any

from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.embedding import run_inputs
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.pooling import ClassificationRequest


def _check_classifier(state: ServerState) -> list[str]:
    pooler = state.engine.config.pooler
    if pooler is None or pooler.task != "classify":
        raise BadRequestError(
            "/classify needs a sequence classifier (a *ForSequenceClassification checkpoint); "
            "this server's model does not classify.",
            "model",
        )
    return pooler.labels


async def create_classification(state: ServerState, req: ClassificationRequest) -> dict[str, Any]:
    state.check_model(req.model)
    labels = _check_classifier(state)
    request_id, prepared, results = await run_inputs(
        state, req, "classify", lambda job, rid: state.engine.classify(job, request_id=rid)
    )
    data = []
    for i, out in enumerate(results):
        probs = out.outputs.probs
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": probs, "num_classes": len(probs)})
    tokens = sum(len(p.prompt_token_ids) for p in prepared)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": req.model or state.served_model_names[0],
        "data": data,
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
