"""``vllm serve``'s flags that shape what the OpenAI routes answer (vLLM's frontend flags of
the same names and meanings): the usage block of an answer and of a stream."""

from __future__ import annotations

import argparse


def add_answer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("answers (vLLM's frontend flags)")
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details (cached_tokens: prompt tokens read from the prefix "
        "cache; on chat also created_cache_tokens: those computed and written to it) on chat "
        "and completion answers; null without it, as in vLLM.",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="Every stream carries usage, as if stream_options asked include_usage and "
        "continuous_usage_stats: on each chunk, and a usage chunk at the end.",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="Logprob tokens as 'token_id:N' (chat and completions) unless a request sets "
        "return_tokens_as_token_ids itself.",
    )
    g.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /tokenizer_info: the tokenizer's configuration (tokenizer_config.json's "
        "fields, its class, the chat template). Behind --api-key like the other routes.",
    )
