"""EngineArgs -> TrillmConfig: resolve the model, the device and the engine's limits.

Each part with an owner is resolved beside it: the parallel world in
``distributed/engine_fit.py``, the pooler in ``model_executor/pooling_fit.py``, the KV
connector and offload tier in ``kv_transfer/engine_fit.py`` and ``offload_fit.py``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from trillm.config import (
    DEFAULT_KV_CACHE_MEMORY,
    CacheConfig,
    EngineArgs,
    LoRAConfig,
    ModelConfig,
    PoolerConfig,
    SchedulerConfig,
    TrillmConfig,
    check_grammar_cache_bytes,
    parse_memory_size,
)
from trillm.config.batch_defaults import UsageContext, batch_limits, device_facts
from trillm.config.multimodal import resolve_limits
from trillm.config.scheduler_checks import check_batch_limits, check_speculative_budget
from trillm.config.structured_outputs import parse_structured_outputs_config
from trillm.distributed.engine_fit import resolve_parallel
from trillm.engine.tokenizer_loader import load_tokenizer
from trillm.kv_transfer.engine_fit import resolve_kv_transfer
from trillm.kv_transfer.offload_fit import resolve_kv_offload
from trillm.model_executor import deepseek_config, hybrid_ssm, llama4_config, transformers_numerics
from trillm.model_executor.pooling_fit import resolve_engine_pooler
from trillm.spec_decode.config import parse_speculative_config

if TYPE_CHECKING:
    from trillm.config.logits_processors import LogitsProcessorSpec
    from trillm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


def resolve_attention_backend(
    args: EngineArgs, device: str, model_dtype: str, architecture: str = ""
) -> str:
    requested = args.attention_backend
    if requested == "eager" and (device != "cpu" or args.kv_cache_dtype != "auto"):
        raise ValueError(
            "The eager attention backend runs on CPU with the KV cache in the model's dtype "
            f"({model_dtype}; kv_cache_dtype auto); got device {device}, kv_cache_dtype "
            f"{args.kv_cache_dtype}."
        )
    if requested is not None:
        return requested
    if args.numerics == "transformers":
        return "eager"
    if architecture in deepseek_config.ARCHITECTURES:  # MLA attends in its own torch ops
        return "torch"
    if architecture in llama4_config.ARCHITECTURES:  # only torch masks chunked attention
        return "torch"
    if device == "cuda":
        try:
            import flashinfer  # noqa: F401

            return "flashinfer"
        except ImportError:
            return "triton"
    return "torch"


def resolve_cache_dtype(requested: str, model_dtype: str, device: str) -> str:
    """The KV cache's storage dtype: ``auto`` the model's; others CPU only (the CUDA backends
    read the model's dtype)."""
    if requested == "auto":
        return model_dtype
    if device != "cpu":
        raise ValueError(
            f"kv_cache_dtype {requested!r} runs on CPU only in trillm, device is "
            f"{device!r}; use auto."
        )
    return "fp8_e4m3" if requested in ("fp8", "fp8_e4m3") else requested


def build_config(
    args: EngineArgs, usage: UsageContext = UsageContext.ENGINE_CONTEXT
) -> TrillmConfig:
    """``usage``: what makes the engine (its defaults: ``config/batch_defaults.py``)."""
    from trillm.model_executor.model_config import load_model_config, resolve_device

    device = resolve_device(args.device)
    model_config = load_model_config(args)
    transformers_numerics.check(args, model_config, device)
    model_config.numerics = args.numerics
    max_model_len = model_config.max_model_len
    parallel = resolve_parallel(args, model_config, device)
    limit_mm = _multimodal_limits(args, model_config)
    if args.block_size <= 0 or args.block_size & (args.block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {args.block_size}.")
    limits = batch_limits(
        args.max_num_batched_tokens,
        args.max_num_seqs,
        usage,
        device_facts(device, parallel.world_size),
        max_model_len,
    )
    check_batch_limits(limits, max_model_len, args.long_prefill_token_threshold)
    kv_memory = (
        parse_memory_size(args.kv_cache_memory)
        if args.kv_cache_memory is not None
        else DEFAULT_KV_CACHE_MEMORY
    )
    pooler = resolve_engine_pooler(args, model_config)
    speculative = parse_speculative_config(args.speculative_config)
    if speculative is not None:
        check_speculative_budget(
            limits, speculative.method, speculative.num_speculative_tokens, args.enable_lora
        )
    draft_model = None
    if speculative is not None and speculative.method != "ngram" and pooler is None:
        from trillm.spec_decode.draft_setup import build_draft_model_config

        draft_model = build_draft_model_config(args, speculative, model_config, load_tokenizer)
    hybrid = hybrid_ssm.check_engine_args(args, model_config, draft_model)
    if pooler is not None and args.enable_prefix_caching:
        # NOTE: a pooled vector needs every prompt row's hidden state: no cached prefixes.
        logger.info("pooling model: prefix caching is off (every prompt row is pooled).")
    longrope = (model_config.rope_scaling or {}).get("rope_type") == "longrope"
    if longrope and args.enable_prefix_caching:
        # NOTE: a block's K/V depend on its request's length there (short or long table), and
        # a request growing past the original context computes its blocks again in place.
        logger.info("longrope model: prefix caching is off (K/V depend on the request's length).")
    return TrillmConfig(
        model=model_config,
        cache=CacheConfig(
            block_size=args.block_size,
            cache_dtype=resolve_cache_dtype(args.kv_cache_dtype, model_config.dtype, device),
            enable_prefix_caching=args.enable_prefix_caching
            and not (pooler is not None or longrope or hybrid),
            kv_cache_memory=kv_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
        ),
        parallel=parallel,
        device=device,
        seed=args.seed,
        attention_backend=resolve_attention_backend(
            args, device, model_config.dtype, model_config.architecture
        ),
        max_logprobs=args.max_logprobs,
        enable_prompt_embeds=_prompt_embeds(args, model_config, pooler, speculative),
        reasoning_parser=args.reasoning_parser,
        structured_outputs=parse_structured_outputs_config(args.structured_outputs_config),
        structured_outputs_cache_bytes=check_grammar_cache_bytes(
            args.structured_outputs_cache_bytes  # (resolved by EngineArgs: an int)
        ),
        lora=_lora_config(args, model_config),
        pooler=pooler,
        speculative=speculative,
        enforce_eager=args.enforce_eager,
        enable_sleep_mode=args.enable_sleep_mode,
        draft_model=draft_model,
        limit_mm_per_prompt=limit_mm,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
        mm_processor_kwargs=dict(args.mm_processor_kwargs or {}),
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        chat_template_content_format=args.chat_template_content_format,
        logits_processors=_logits_processors(args, pooler, speculative),
        kv_transfer=resolve_kv_transfer(args, model_config, pooler, speculative, hybrid, longrope),
        kv_offload=resolve_kv_offload(args, model_config, pooler, speculative, hybrid, longrope),
    )


def _logits_processors(
    args: EngineArgs, pooler: PoolerConfig | None, speculative: SpeculativeConfig | None
) -> list[LogitsProcessorSpec]:
    """--logits-processors (and the installed plugins) as specs; refused, as in vLLM, for
    pooling models and with speculative decoding (drafts are verified row by row)."""
    from trillm.config.logits_processors import resolve_logits_processors

    specs = resolve_logits_processors(args.logits_processors)
    why = None
    if specs and pooler is not None:
        why = "pooling models do not sample, so they take no logits processors"
    elif specs and speculative is not None:
        why = "not supported with speculative decoding (as in vLLM)"
    if why is not None:
        names = ", ".join(spec.name for spec in specs)
        raise ValueError(f"logits_processors (--logits-processors) {names}: {why}.")
    return specs


def _multimodal_limits(args: EngineArgs, model_config: ModelConfig) -> dict[str, int]:
    """``limit_mm_per_prompt`` resolved for the model; what its inputs cannot run with yet
    is refused by name."""
    from trillm.model_executor.registry import get_model_class, model_entry

    arch = model_config.architecture
    limits = resolve_limits(args.limit_mm_per_prompt, model_entry(arch).modalities, arch)
    if model_config.mm_config is None:
        if args.mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs: {arch} takes no multimodal inputs.")
        return limits
    # With pipeline parallelism the tower runs on the first stage: the models that say which
    # modules are its (FIRST_STAGE_MODULES)
    staged = bool(getattr(get_model_class(arch), "FIRST_STAGE_MODULES", ()))
    for name, unsupported in (
        ("pipeline_parallel_size", not staged and args.pipeline_parallel_size > 1),
        ("runner", args.runner == "pooling"),
        ("convert", args.convert not in ("auto", "none")),
    ):
        if unsupported:
            raise ValueError(f"{arch}: {name}={getattr(args, name)!r} is not supported yet.")
    if args.mm_processor_kwargs and "audio" in model_entry(arch).modalities:
        raise ValueError(f"mm_processor_kwargs: not supported for {arch}'s audio inputs yet.")
    if args.mm_processor_kwargs:  # each key one the folder's image processor takes
        from trillm.engine.image_processors import check_keywords, load_image_processor

        processor = load_image_processor(model_config.model)
        check_keywords(processor, args.mm_processor_kwargs, "mm_processor_kwargs")
    return limits


def _prompt_embeds(
    args: EngineArgs,
    model_config: ModelConfig,
    pooler: PoolerConfig | None,
    speculative: SpeculativeConfig | None,
) -> bool:
    """--enable-prompt-embeds, refused by name where the embeddings could not reach the
    model's first layer as given."""
    if not args.enable_prompt_embeds:
        return False
    from trillm.model_executor.registry import get_model_class

    arch = model_config.architecture
    why = None
    if pooler is not None:
        why = "pooling models take token prompts only"
    elif speculative is not None:
        why = "speculative decoding proposes from token ids"
    elif args.pipeline_parallel_size > 1:
        why = "pipeline parallelism is not supported with it yet"
    elif not getattr(get_model_class(arch), "ACCEPTS_PROMPT_EMBEDS", False):
        why = f"{arch} does not take prompt embeddings in trillm yet"
    if why is not None:
        raise ValueError(f"--enable-prompt-embeds: {why}.")
    return True


def _lora_config(args: EngineArgs, model: ModelConfig) -> LoRAConfig | None:
    """enable_lora -> the LoRA config; ValueError where LoRA cannot run (naming why)."""
    from trillm.lora.peft import LORA_ARCHITECTURES

    if not args.enable_lora:
        return None
    if model.architecture not in LORA_ARCHITECTURES:
        raise ValueError(
            f"enable_lora: LoRA is not implemented for {model.architecture} (it runs on "
            f"{', '.join(sorted(LORA_ARCHITECTURES))})."
        )
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)
