"""Scoring text pairs (vLLM's score task), for ``/score``, ``/rerank`` and ``LLM.score``.

``text_1`` and ``text_2`` pair up 1:1, 1:N (the one ``text_1`` with each ``text_2``) or N:N.
With a cross-encoder (a BERT-family ``*ForSequenceClassification`` with one label) each pair
is one prompt, tokenized as the tokenizer joins a pair (``[CLS] a [SEP] b [SEP]``, segment ids
0 then 1), and its score is the model's (``worker/encoder_runner.py``). With an embedding
model each text is embedded once and a pair's score is the cosine similarity of its two
vectors. How the prompts run is the caller's (``run``): the server admits them against its
budgets first, ``LLM.score`` runs them as they are.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
import trio

from trillm.config import TrillmConfig
from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt, Preprocessor
from trillm.model_executor.encoder_config import ACTIVATION_KEY, TOKEN_TYPE_KEY, is_encoder
from trillm.outputs import ScoringOutput, ScoringRequestOutput, pooling_params

# (prepared prompts, "embed" or "classify") -> each one's PoolingRequestOutput /
# ClassificationRequestOutput, in order
RunPrompts = Callable[[list[PreparedPrompt], str], Awaitable[list[Any]]]


def check_lengths(n_1: int, n_2: int) -> None:
    """vLLM's rule and wording."""
    if n_1 == 0:
        raise InvalidRequestError("At least one text element must be given", "text_1")
    if n_2 == 0:
        raise InvalidRequestError("At least one text_pair element must be given", "text_2")
    if n_1 > 1 and n_1 != n_2:
        raise InvalidRequestError("Input lengths must be either 1:1, 1:N or N:N", "text_1")


def score_task(config: TrillmConfig) -> str:
    """ "embed" (cosine similarity) or "classify" (a cross-encoder), else a 400 naming why."""
    pooler = config.pooler
    if pooler is None:
        raise InvalidRequestError(
            "Scoring needs a pooling model (an embedding model or a cross-encoder); this "
            "server generates text.",
            "model",
        )
    if pooler.task == "embed":
        return "embed"
    if not is_encoder(config.model.architecture):
        raise InvalidRequestError(
            "Scoring with a decoder sequence classifier is not implemented; cross-encoders "
            "of the BERT family (BertForSequenceClassification, "
            "XLMRobertaForSequenceClassification, ModernBertForSequenceClassification) and "
            "embedding models score.",
            "model",
        )
    if len(pooler.labels) != 1:
        raise InvalidRequestError(
            f"Scoring needs a cross-encoder with one label; this model has {len(pooler.labels)}.",
            "model",
        )
    return "classify"


async def pair_prompt(
    pre: Preprocessor,
    text_1: str,
    text_2: str,
    truncate: int | None,
    activation: bool,
    priority: int = 0,
) -> PreparedPrompt:
    """A cross-encoder's prompt for one pair, truncated as the tokenizer truncates a pair
    (longest first) when ``truncate`` (-1: the context length) says so."""
    if truncate is None and len(text_1) + len(text_2) > pre.max_prompt_chars():
        max_len = pre.max_model_len
        raise InvalidRequestError(
            f"This model's maximum context length is {max_len} tokens; the pair's "
            f"{len(text_1) + len(text_2)} characters are more than it can hold.",
            "text_2",
        )
    limit = None if truncate is None else (pre.max_model_len if truncate == -1 else truncate)

    def work() -> Mapping[str, list[int]]:
        if limit is None:
            return pre.tokenizer(text_1, text_2)
        return pre.tokenizer(text_1, text_2, truncation=True, max_length=limit)

    enc = await trio.to_thread.run_sync(work, limiter=pre.tokenize_limiter)
    types = list(enc.get("token_type_ids") or [])
    params = pooling_params()
    params.extra_args = {ACTIVATION_KEY: activation}
    if 1 in types:
        params.extra_args[TOKEN_TYPE_KEY] = types.index(1)
    ids = list(enc["input_ids"])
    return pre.prepare_ids(ids, params, priority=priority, prompt_param="text_2")


def cosine(a: list[float], b: list[float]) -> float:
    """torch's cosine_similarity (each norm at least 1e-8)."""
    va, vb = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norms = max(float(np.linalg.norm(va)), 1e-8) * max(float(np.linalg.norm(vb)), 1e-8)
    return float(va @ vb / norms)


async def score_pairs(
    config: TrillmConfig,
    pre: Preprocessor,
    texts_1: list[str],
    texts_2: list[str],
    truncate: int | None,
    run: RunPrompts,
    activation: bool = True,
    priority: int = 0,
) -> tuple[list[ScoringRequestOutput], int]:
    """Each pair's score, in ``texts_2``'s order, and the prompt tokens the model ran."""
    check_lengths(len(texts_1), len(texts_2))
    firsts = texts_1 * len(texts_2) if len(texts_1) == 1 else texts_1
    request_id = f"score-{uuid.uuid4().hex}"
    if score_task(config) == "classify":
        pairs = zip(firsts, texts_2, strict=True)
        prepared = [await pair_prompt(pre, a, b, truncate, activation, priority) for a, b in pairs]
        results = await run(prepared, "classify")
        outs = [
            ScoringRequestOutput(
                f"{request_id}-{i}", r.prompt_token_ids, ScoringOutput(r.outputs.probs[0])
            )
            for i, r in enumerate(results)
        ]
        return outs, sum(len(p.prompt_token_ids) for p in prepared)
    if not activation:
        raise InvalidRequestError(
            "use_activation applies to a cross-encoder's score; an embedding model's score is "
            "the cosine similarity.",
            "use_activation",
        )
    prepared = [await _text_prompt(pre, t, truncate, priority) for t in texts_1 + texts_2]
    results = await run(prepared, "embed")
    vecs_1, vecs_2 = results[: len(texts_1)], results[len(texts_1) :]
    if len(vecs_1) == 1:
        vecs_1 = vecs_1 * len(vecs_2)
    outs = [
        ScoringRequestOutput(
            f"{request_id}-{i}",
            a.prompt_token_ids + b.prompt_token_ids,
            ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding)),
        )
        for i, (a, b) in enumerate(zip(vecs_1, vecs_2, strict=True))
    ]
    return outs, sum(len(p.prompt_token_ids) for p in prepared)


async def _text_prompt(
    pre: Preprocessor, text: str, truncate: int | None, priority: int
) -> PreparedPrompt:
    ids = await pre.tokenize(text, True, param="text_1", truncating=truncate is not None)
    params = pooling_params(truncate)
    return pre.prepare_ids(ids, params, text=text, priority=priority, prompt_param="text_1")
