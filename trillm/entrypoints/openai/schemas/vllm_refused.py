"""vLLM request fields this server does not implement, per request schema: sent with a value
that asks for something, each is a 400 naming it (``structuring.structure`` checks them); sent
null or at vLLM's default, it asks for nothing and passes.

Fields outside vLLM's protocol keep vLLM's behaviour: ignored with a warning. The list these
come from, and the test that every vLLM field is honoured or in here, are
``tests/support/field_coverage/vllm_fields.json`` and ``tests/entrypoints/test_vllm_field_list.py``.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Refusal:
    reason: str  # what the field asks for that this server does not do
    # vLLM's default (and null): the field asks for nothing, so it is accepted
    asks_nothing: tuple[Any, ...] = (None,)


def _group(reason: str, *names: str, asks_nothing: tuple[Any, ...] = (None,)) -> dict[str, Refusal]:
    return dict.fromkeys(names, Refusal(reason, asks_nothing))


_DISAGG = {
    **_group(
        "the KV connectors here (--kv-transfer-config) take no per-request parameters: "
        "SharedStorageConnector finds a prompt's KV by its tokens, P2pNcclConnector by the "
        "prefill address in the request id (as vLLM's); NixlConnector, which reads them, is "
        "not implemented",
        "kv_transfer_params",
    ),
    **_group("encoder-cache transfer between instances is not implemented", "ec_transfer_params"),
}
_MEDIA_IO = _group(
    "per-request media connector options (a video_url's frames) are taken by "
    "/v1/chat/completions only; this route loads media with the server's settings",
    "media_io_kwargs",
)
_TRUNCATION_SIDE = _group(
    "only 'left' truncation is implemented: truncate_prompt_tokens keeps the last tokens of the "
    "prompt (vLLM's default side)",
    "truncation_side",
    asks_nothing=(None, "left"),
)
_GENERATION = {
    **_DISAGG,
    **_group("repetition detection is not implemented", "repetition_detection"),
    **_group("output watermarking is not implemented", "watermarking", asks_nothing=(None, False)),
    **_group(
        "weights are not versioned here (no in-place weight updates)",
        "return_weight_versions",
        asks_nothing=(None, False),
    ),
    **_group(
        "the routed experts of a mixture-of-experts model are not returned",
        "routed_experts_prompt_start",
        asks_nothing=(None, 0),
    ),
    **_group("sessions are not tracked (no session-scoped caching or routing)", "session_id"),
}
_CHAT_TEMPLATE_OPTIONS = _group(
    "chat messages are not taken by the pooling and scoring routes; send the text as 'input'",
    "messages",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    asks_nothing=(None, False),
)
_POOLING = {
    **_TRUNCATION_SIDE,
    **_MEDIA_IO,
    **_CHAT_TEMPLATE_OPTIONS,
    **_group(
        "the special tokens are always added, as the model's tokenizer adds them",
        "add_special_tokens",
        asks_nothing=(None, True),
    ),
    **_group(
        "embeddings are sent as float32 (base64 of little-endian float32 with "
        "encoding_format 'base64')",
        "embed_dtype",
        asks_nothing=(None, "float32"),
    ),
    **_group(
        "base64 embeddings are little-endian float32",
        "endianness",
        asks_nothing=(None, "native", "little"),
    ),
    **_group("prompts are not padded", "padding"),
    **_group(
        "--scheduling-policy priority is not offered on the pooling routes",
        "priority",
        asks_nothing=(None, 0),
    ),
    **_group("the pooling routes keep no prefix cache to salt", "cache_salt"),
    **_group(
        "the response id is generated; a client's request_id is taken on the generation "
        "routes only",
        "request_id",
    ),
    **_group(
        "the pooler's activation is the model's (use_activation is taken by /score and /rerank)",
        "use_activation",
    ),
    **_group(
        "images are not taken by the pooling routes (text and token ids only)",
        "mm_processor_kwargs",
    ),
}
_SCORING = {
    **_TRUNCATION_SIDE,
    **_group(
        "scoring instructions are not rendered (no instruction-tuned rerankers here)",
        "instruction",
    ),
    **_group(
        "per-side token limits are not implemented; truncate_prompt_tokens truncates the pair",
        "max_tokens_per_doc",
        "max_tokens_per_query",
        asks_nothing=(None, 0),
    ),
    **_group("prompts are not padded", "padding"),
    **_group("the scoring routes keep no prefix cache to salt", "cache_salt"),
    **_group(
        "the response id is generated; a client's request_id is taken on the generation "
        "routes only",
        "request_id",
    ),
    **_group("cross-encoders here render no chat template", "chat_template_kwargs"),
}

# trillm request schema (class name) -> vLLM field -> why it is refused
REFUSED: dict[str, dict[str, Refusal]] = {
    "ChatCompletionRequest": {
        **_GENERATION,
        **_group(
            "the rendered prompt is not returned (POST /tokenize with the messages gives its "
            "tokens)",
            "return_prompt_text",
            asks_nothing=(None, False),
        ),
    },
    "CompletionRequest": dict(_GENERATION),
    "EmbeddingRequest": _POOLING,
    "PoolingRequest": {
        **_POOLING,
        **_group(
            "IO-processor plugins are not supported; /pooling takes 'input' and returns the "
            "pooled vectors",
            "data",
            "task",
        ),
    },
    "ScoreRequest": {
        **_SCORING,
        **_group(
            "/score takes the pair as text_1 / text_2 (text only); the data_1 / data_2, "
            "queries / documents and queries / items forms are not taken",
            "data_1",
            "data_2",
            "queries",
            "documents",
            "items",
        ),
    },
    "RerankRequest": _SCORING,
    "TokenizeRequest": {
        **_MEDIA_IO,
        **_group(
            "a request's chat template is taken by /v1/chat/completions only; /tokenize "
            "renders with the server's",
            "chat_template",
        ),
        **_group("response formats are not rendered by /tokenize", "response_format"),
    },
}


def refusal(schema: str, field: str, value: Any) -> str | None:
    """The 400's message when ``value`` of vLLM's ``field`` asks for what ``schema``'s route
    does not do; None when it asks for nothing or is not one of vLLM's fields."""
    found = REFUSED.get(schema, {}).get(field)
    if found is None or any(value == v and type(value) is type(v) for v in found.asks_nothing):
        return None
    return f"'{field}' is not supported: {found.reason}."
