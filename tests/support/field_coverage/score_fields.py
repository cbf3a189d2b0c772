"""Coverage of /score's and /rerank's request fields: ``Class.field`` -> node ids."""

from __future__ import annotations

from field_coverage.ids import ids

SCORE = "tests/entrypoints/test_score_rerank_http.py::"
_REFUSED = SCORE + "test_what_the_scoring_routes_refuse"
_COMMON = {
    "model": ids(_REFUSED),
    "truncate_prompt_tokens": ids(SCORE + "test_truncate_prompt_tokens_truncates_the_pair"),
    "priority": ids(_REFUSED),  # refused without --scheduling-policy priority
    "use_activation": ids(SCORE + "test_activation_off_gives_the_logit"),
    "activation": ids(SCORE + "test_activation_off_gives_the_logit"),
    "softmax": ids(SCORE + "test_activation_off_gives_the_logit"),
    "mm_processor_kwargs": ids(_REFUSED),
}
_SCORE = {
    "text_1": ids(SCORE + "test_score_equals_the_cross_encoders", _REFUSED),
    "text_2": ids(SCORE + "test_score_equals_the_cross_encoders", _REFUSED),
}
_RERANK = {
    "query": ids(SCORE + "test_rerank_sorts_by_relevance", _REFUSED),
    "documents": ids(SCORE + "test_rerank_sorts_by_relevance", _REFUSED),
    "top_n": ids(SCORE + "test_rerank_top_n_and_return_documents"),
    "return_documents": ids(SCORE + "test_rerank_top_n_and_return_documents"),
}
SCORE_FIELDS: dict[str, tuple[str, ...]] = {
    **{f"ScoreRequest.{k}": v for k, v in {**_COMMON, **_SCORE}.items()},
    **{f"RerankRequest.{k}": v for k, v in {**_COMMON, **_RERANK}.items()},
}
