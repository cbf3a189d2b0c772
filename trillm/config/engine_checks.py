"""``EngineArgs``' checks across its fields, run when it is made: honour or refuse, so what
trillm cannot do is refused by the field's name before anything loads, and the values other
modules read are normalized here (the media limits and paths, the grammar cache's bytes)."""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol

from trillm.config.mm_processor_cache import check_mm_processor_cache_gb
from trillm.config.multimodal import check_limit_mm_per_prompt, check_media_args
from trillm.config.parallel import ParallelArgs, check_parallel
from trillm.config.pooling import check_runner
from trillm.config.scheduler_checks import GIVEN_FIELDS, check_given
from trillm.config.values import (
    Convert,
    KVCacheDtype,
    Numerics,
    check_grammar_cache_bytes,
    check_kv_cache_dtype,
    check_numerics,
    grammar_cache_bytes_from_env,
)

logger = logging.getLogger(__name__)


class CheckedArgs(ParallelArgs, Protocol):
    """The fields of ``EngineArgs`` checked or normalized here (a Protocol: engine_args.py
    imports this module)."""

    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    long_prefill_token_threshold: int
    stream_interval: int
    gpu_memory_utilization: float
    scheduling_policy: Literal["fcfs", "priority"]
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    structured_outputs_config: dict[str, Any] | None
    reasoning_parser: str | None
    quantization: str | None
    kv_cache_dtype: KVCacheDtype
    structured_outputs_cache_bytes: int | str | None
    numerics: Numerics
    limit_mm_per_prompt: dict[str, int] | None
    allowed_local_media_path: str
    allowed_media_domains: list[str] | None
    mm_processor_kwargs: dict[str, Any] | None
    mm_processor_cache_gb: float
    runner: str
    convert: Convert
    pooler_config: dict[str, Any] | None
    speculative_config: dict[str, Any] | str | None
    trust_remote_code: bool
    skip_mm_profiling: bool


def check_engine_args(args: CheckedArgs) -> None:
    """ValueError naming the field that trillm cannot honour; normalizes the rest in place."""
    check_given({name: getattr(args, name) for name in GIVEN_FIELDS})  # the scheduler's, cache's
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    cpu = args.max_cpu_loras
    if cpu is not None and (not isinstance(cpu, int) or cpu < args.max_loras):
        raise ValueError(  # (vLLM's rule: the adapters in slots are in the CPU cache too)
            f"max_cpu_loras must be an integer >= max_loras ({args.max_loras}), got {cpu!r}."
        )
    check_parallel(args)
    _take_structured_outputs_config(args)
    _check_plugins(args)
    check_kv_cache_dtype(args.kv_cache_dtype)
    args.structured_outputs_cache_bytes = (
        grammar_cache_bytes_from_env()
        if args.structured_outputs_cache_bytes is None
        else check_grammar_cache_bytes(args.structured_outputs_cache_bytes)
    )
    check_numerics(args.numerics)
    _check_media(args)
    check_runner(args.runner, args.convert, args.pooler_config)  # ValueError naming it
    from trillm.spec_decode.config import parse_speculative_config

    parse_speculative_config(args.speculative_config)  # ValueError naming the key
    _log_accepted_without_effect(args)


def _take_structured_outputs_config(args: CheckedArgs) -> None:
    """Check ``structured_outputs_config``; load its reasoning parser plugin; its
    reasoning_parser is ``reasoning_parser`` (the two must agree when both are given)."""
    from trillm.config.structured_outputs import parse_structured_outputs_config

    so = parse_structured_outputs_config(args.structured_outputs_config)
    if so.reasoning_parser_plugin:
        from trillm.parsers.plugin_files import run_plugin_file

        run_plugin_file(so.reasoning_parser_plugin, "reasoning_parser_plugin")
    if so.reasoning_parser:
        if args.reasoning_parser not in (None, so.reasoning_parser):
            raise ValueError(
                f"reasoning_parser {args.reasoning_parser!r} and structured_outputs_config."
                f"reasoning_parser {so.reasoning_parser!r} disagree: give one."
            )
        args.reasoning_parser = so.reasoning_parser


def _check_plugins(args: CheckedArgs) -> None:
    """The named reasoning parser and quantization method exist (their modules load only when
    one is named)."""
    if args.reasoning_parser is not None:
        from trillm.parsers.reasoning import get_reasoning_parser

        get_reasoning_parser(args.reasoning_parser)  # ValueError naming the known ones
    if args.quantization is not None:
        from trillm.model_executor.quantization import check_quantization

        check_quantization(args.quantization)  # ValueError naming the method


def _check_media(args: CheckedArgs) -> None:
    args.limit_mm_per_prompt = check_limit_mm_per_prompt(args.limit_mm_per_prompt)
    args.allowed_local_media_path, args.allowed_media_domains, args.mm_processor_kwargs = (
        check_media_args(
            args.allowed_local_media_path, args.allowed_media_domains, args.mm_processor_kwargs
        )
    )
    args.mm_processor_cache_gb = check_mm_processor_cache_gb(args.mm_processor_cache_gb)


def _log_accepted_without_effect(args: CheckedArgs) -> None:
    """Accepted with vLLM's meaning where nothing here differs; said once in the log."""
    if args.trust_remote_code:
        logger.info(
            "trust_remote_code: the checkpoint's tokenizer code may run; its model "
            "code never does (trillm's own model implementations are used)."
        )
    if args.skip_mm_profiling:
        logger.info(
            "skip_mm_profiling: trillm runs no memory-profiling pass at start (the "
            "encoder's or any other); nothing to skip."
        )
