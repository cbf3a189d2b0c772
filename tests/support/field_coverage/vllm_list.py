"""vLLM's own list of request fields and ``VLLM_*`` variables (``vllm_fields.json``, written by
``vllm_fields_gen.py`` from vLLM's source) and what covers each here; checked by
tests/entrypoints/test_vllm_field_list.py.

A vLLM field is covered when trillm's schema for that route declares it (then the field
coverage table names the tests of its effect or refusal), when it is in
``trillm/entrypoints/openai/schemas/vllm_refused.py`` or the route refuses every field it does
not declare (the refusal test sends each), or when vLLM itself ignores it on that route
(``IGNORED_AS_IN_VLLM``, with the reason). A variable is covered when ``trillm/envs.py`` reads
it (``ENV_EFFECTS`` names the test of its effect), ``trillm/vllm_env.py`` refuses it, or lists
it as without effect here, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

VLLM = json.loads(Path(__file__).with_name("vllm_fields.json").read_text())

# vLLM's endpoint (the JSON's key) -> trillm's request schema: module of
# trillm.entrypoints.openai.schemas, class
SCHEMAS = {
    "chat": ("protocol", "ChatCompletionRequest"),
    "completions": ("protocol", "CompletionRequest"),
    "responses": ("responses", "ResponsesRequest"),
    "embeddings": ("pooling", "EmbeddingRequest"),
    "pooling": ("pooling", "PoolingRequest"),
    "score": ("score", "ScoreRequest"),
    "rerank": ("score", "RerankRequest"),
    "tokenize": ("protocol", "TokenizeRequest"),
    "detokenize": ("protocol", "DetokenizeRequest"),
    "messages": ("anthropic", "MessagesRequest"),
    "count_tokens": ("anthropic", "CountTokensRequest"),
}
# Routes that answer 400 to any field they do not declare (their schemas' docstrings say why).
REFUSE_UNDECLARED = {"responses", "messages", "count_tokens"}

_RENDER_ONLY = (
    "vLLM reads it on its /render endpoints only and ignores it on this route (its field "
    "description says so); ignored here too, with the unknown-field warning"
)
_USER = (
    "OpenAI's end-user id; vLLM's pooling and scoring routes accept it and ignore it, as here "
    "(with the unknown-field warning)"
)
IGNORED_AS_IN_VLLM: dict[tuple[str, str], str] = {
    **{
        (endpoint, field): _RENDER_ONLY
        for endpoint in ("chat", "completions")
        for field in ("mm_payload", "return_mm_kwargs", "return_token_offsets")
    },
    **{(endpoint, "user"): _USER for endpoint in ("embeddings", "pooling", "score", "rerank")},
}

# A VLLM_* variable trillm reads with vLLM's meaning -> tests that show its effect.
ENV_EFFECTS: dict[str, tuple[str, ...]] = {
    "VLLM_API_KEY": ("tests/fault/test_api_key_routes.py::test_vllm_api_key_is_read",),
    "VLLM_XGRAMMAR_CACHE_MB": (
        "tests/fault/test_grammar_cache_bytes.py::test_vllm_xgrammar_cache_mb_sets_the_default",
    ),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": (
        "tests/entrypoints/test_lora_http.py::test_runtime_updating_env_is_the_flag",
    ),
    "VLLM_ENABLE_RESPONSES_API_STORE": (
        "tests/entrypoints/test_responses_store.py::test_a_stored_response_is_returned_by_get",
        "tests/entrypoints/test_responses_api.py::test_without_the_store",
    ),
    "VLLM_SERVER_DEV_MODE": (
        "tests/entrypoints/test_dev_routes.py::test_without_dev_mode_the_routes_do_not_exist",
    ),
    "VLLM_CONFIGURE_LOGGING": (
        "tests/entrypoints/test_logging_config.py::test_configure_logging_0_leaves_logging_alone",
    ),
    "VLLM_LOGGING_LEVEL": (
        "tests/entrypoints/test_logging_config.py::test_vllm_logging_level_sets_trillms_loggers",
    ),
    "VLLM_LOGGING_CONFIG_PATH": (
        "tests/entrypoints/test_logging_config.py::test_vllm_logging_config_path_is_used_as_is",
    ),
    "VLLM_IMAGE_FETCH_TIMEOUT": (
        "tests/entrypoints/test_llava_http.py::"
        "test_bad_urls_are_400_within_the_limit_while_a_stream_runs",
    ),
    "VLLM_VIDEO_FETCH_TIMEOUT": (
        "tests/engine/test_media_fetch_timeouts.py::"
        "test_video_fetch_timeout_and_audio_fetch_timeout_are_read",
    ),
    "VLLM_AUDIO_FETCH_TIMEOUT": (
        "tests/engine/test_media_fetch_timeouts.py::"
        "test_video_fetch_timeout_and_audio_fetch_timeout_are_read",
    ),
    "VLLM_CPU_OMP_THREADS_BIND": (
        "tests/parallel/test_cpu_binding.py::"
        "test_each_rank_runs_one_thread_per_core_on_its_own_core",
    ),
    "VLLM_CPU_NUM_OF_RESERVED_CPU": (
        "tests/parallel/test_cpu_binding.py::"
        "test_auto_splits_the_usable_cores_less_the_reserved_ones",
    ),
}


def asking_value(default: object) -> object:
    """A value of a field that asks for something: other than its vLLM default and not null."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, str) and not default.startswith("<"):
        return default + "-other"
    if isinstance(default, list):
        return ["other"]
    if isinstance(default, dict) and "expr" not in default:
        return {"other": 1}
    return "other"  # default null, required (another shape of request), or computed
