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
        "cache) on chat and completion answers; null without it, as in vLLM.",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="Every stream carries usage, as if stream_options asked include_usage and "
        "continuous_usage_stats: on each chunk, and a usage chunk at the end.",
    )
