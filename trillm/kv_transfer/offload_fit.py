"""``--kv-offloading-size GiB`` / ``--kv-offloading-backend`` (vLLM's names): the KV offload
tier, resolved for an engine.

vLLM turns the two flags into a KV connector (``native``: its ``OffloadingConnector``, kv_both,
the size as the CPU tier's bytes; ``lmcache``: LMCache's connector). trillm does the same with
its own connector machinery (``offload.py``). On a CPU engine the paged KV cache already lives
in host memory, so ``native`` is a second pool of host memory beside it: its own bytes,
allocated apart from ``--kv-cache-memory``, holding blocks the KV cache computed, LRU.
"""

from __future__ import annotations

import math
from typing import Any

from trillm.config import EngineArgs, ModelConfig
from trillm.kv_transfer.engine_fit import unsupported_with_connector
from trillm.kv_transfer.offload_config import BACKENDS, KVOffloadConfig

# CacheConfig.cache_dtype (or the model's dtype under "auto") -> bytes of one element
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}


def resolve_kv_offload(
    args: EngineArgs,
    model: ModelConfig,
    pooler: Any,
    speculative: Any,
    hybrid: bool,
    longrope: bool,
) -> KVOffloadConfig | None:
    """None without ``--kv-offloading-size``; else the tier, or a ValueError naming what it
    cannot take."""
    size = args.kv_offloading_size
    backend = args.kv_offloading_backend
    if backend not in BACKENDS:
        raise ValueError(f"kv_offloading_backend must be one of {BACKENDS}, got {backend!r}.")
    if size is None:
        return None  # vLLM: the backend is used only when a size is set
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size):
        raise ValueError(f"kv_offloading_size must be a number of GiB, got {size!r}.")
    if size <= 0:
        raise ValueError(f"kv_offloading_size must be positive, got {size}.")
    if backend == "lmcache":
        raise ValueError(
            "kv_offloading_backend 'lmcache' is not implemented (LMCache's connector needs "
            "CUDA); use kv_offloading_backend 'native'."
        )
    if args.kv_transfer_config is not None:
        raise ValueError(
            "kv_offloading_size with kv_transfer_config: not implemented (vLLM would replace "
            "the connector; trillm runs one connector per engine)."
        )
    for name, used in unsupported_with_connector(
        args, model, pooler, speculative, hybrid, longrope
    ).items():
        if used:
            raise ValueError(f"kv_offloading_size with {name}: not implemented.")
    return _tier(args, model, int(size * (1 << 30)))


def _tier(args: EngineArgs, model: ModelConfig, size_bytes: int) -> KVOffloadConfig:
    """``size_bytes`` over every rank (vLLM's: the size is the tier's total over the tensor x
    pipeline ranks): each rank holds its share of each tier block, its heads of its stage's
    layers, as its KV cache does."""
    from trillm.distributed.pipeline import stage_layers
    from trillm.distributed.sharding import RankShapes
    from trillm.model_executor.registry import kv_cache_layout

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    heads = RankShapes.of(model, 0, tp, args.enable_expert_parallel).num_kv_heads
    layout = kv_cache_layout(model, heads)
    dtype = model.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    element = _ELEMENT_BYTES[{"fp8": "fp8_e4m3"}.get(dtype, dtype)]
    per_layer = layout.elements_per_token * element * args.block_size
    rank_bytes = []
    for stage in range(pp):
        first, end = stage_layers(model.num_hidden_layers, pp, stage)
        rank_bytes += [(end - first) * per_layer] * tp
    block_bytes = sum(rank_bytes)
    num_blocks = size_bytes // block_bytes
    if num_blocks == 0:
        raise ValueError(
            f"kv_offloading_size ({size_bytes} bytes) holds no KV block of {block_bytes} "
            f"bytes ({args.block_size} tokens of this model); raise it."
        )
    return KVOffloadConfig(num_blocks, block_bytes, size_bytes, tuple(rank_bytes))
