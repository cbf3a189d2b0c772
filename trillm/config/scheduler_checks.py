"""vLLM's startup checks of the scheduler's and cache's values, in one place: what vLLM refuses
trillm refuses, naming the flags and their values.

``check_given``: the values that need no model (vLLM's field bounds, ``max_num_batched_tokens >=
max_num_seqs`` when both are given), run as soon as they are given: ``EngineArgs`` at its
making, ``trillm serve``'s flags before the model is read (an argparse error, exit 2).
``check_batch_limits``: the limits with their defaults resolved (``batch_defaults.py``) against
the model's length (``SchedulerConfig.verify_max_model_len``): the budget at least the batch,
``long_prefill_token_threshold`` at most ``max_model_len``; a budget above ``max_num_seqs`` x
``max_model_len`` is logged as vLLM warns. ``check_speculative_budget``: room for the drafts
(``create_engine_config`` / ``VllmConfig``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from trillm.config.batch_defaults import BatchLimits

logger = logging.getLogger(__name__)

POLICIES = ("fcfs", "priority")
# The fields check_given reads (EngineArgs' names; trillm serve's flags' dests).
GIVEN_FIELDS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "long_prefill_token_threshold",
    "stream_interval",
    "gpu_memory_utilization",
    "scheduling_policy",
)


def check_given(values: Mapping[str, Any]) -> None:
    """ValueError naming the first value vLLM refuses; a name absent or None is left to its
    default."""
    for name, least in (
        ("max_num_batched_tokens", 1),
        ("max_num_seqs", 1),
        ("stream_interval", 1),
        ("long_prefill_token_threshold", 0),
    ):
        value = values.get(name)
        if value is not None and (not _is_int(value) or value < least):
            raise ValueError(
                f"{name} (--{_flag(name)}) must be an integer >= {least}, got {value!r}."
            )
    tokens, seqs = values.get("max_num_batched_tokens"), values.get("max_num_seqs")
    if tokens is not None and seqs is not None and tokens < seqs:
        raise ValueError(
            f"max_num_batched_tokens ({tokens}) must be greater than or equal to max_num_seqs "
            f"({seqs}): each step schedules a token of every running request. Raise "
            "--max-num-batched-tokens or lower --max-num-seqs."
        )
    util = values.get("gpu_memory_utilization")
    if util is not None and (
        isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1
    ):
        raise ValueError(
            f"gpu_memory_utilization (--gpu-memory-utilization) must be a fraction in (0, 1], "
            f"got {util!r}."
        )
    policy = values.get("scheduling_policy")
    if policy is not None and policy not in POLICIES:
        raise ValueError(
            f"scheduling_policy (--scheduling-policy) must be one of {', '.join(POLICIES)}, "
            f"got {policy!r}."
        )


def check_batch_limits(
    limits: BatchLimits, max_model_len: int, long_prefill_token_threshold: int
) -> None:
    """The limits with their defaults resolved, against the model's length."""
    tokens, seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    threshold = long_prefill_token_threshold
    check_given(
        {
            "max_num_batched_tokens": tokens,
            "max_num_seqs": seqs,
            "long_prefill_token_threshold": threshold,
        }
    )
    if threshold > max_model_len:
        raise ValueError(
            f"long_prefill_token_threshold ({threshold}) cannot be greater than max_model_len "
            f"({max_model_len}): lower --long-prefill-token-threshold or raise --max-model-len."
        )
    if tokens > seqs * max_model_len:
        logger.warning(  # vLLM warns the same: no step can fill the budget
            "max_num_batched_tokens (%d) exceeds max_num_seqs x max_model_len (%d x %d).",
            tokens,
            seqs,
            max_model_len,
        )


def check_speculative_budget(
    limits: BatchLimits, method: str, num_speculative_tokens: int, lora: bool
) -> None:
    """Room in the budget for a draft model's extra slot a step, and, with LoRA on too, for
    every request's drafts and bonus token."""
    tokens, seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    if method == "draft_model" and tokens <= 1:
        raise ValueError(
            f"max_num_batched_tokens ({tokens}) leaves no room for speculative_config's "
            "draft_model, which takes one more slot a step: raise --max-num-batched-tokens."
        )
    needed = seqs * (num_speculative_tokens + 1)
    if lora and tokens < needed:
        raise ValueError(
            f"max_num_batched_tokens ({tokens}) is less than max_num_seqs ({seqs}) x "
            f"(num_speculative_tokens ({num_speculative_tokens}) + 1) = {needed}, which LoRA "
            "with speculative decoding needs: raise --max-num-batched-tokens, or lower "
            "--max-num-seqs or speculative_config's num_speculative_tokens."
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(name: str) -> str:
    return name.replace("_", "-")
