"""How many KV-cache blocks a rank holds (stage 7's memory): the cache's dtype, the bytes of one
block over the rank's layers (its pipeline stage's, in the layout its model declares: its
tensor-parallel share of the KV heads, or MLA's latent; the draft model's too), the budget they
share (``--kv-cache-memory`` on CPU, ``gpu_memory_utilization`` of the device on CUDA, or
``num_gpu_blocks_override``), and the check that one request of ``max_model_len`` tokens fits.
The model runner asks these at startup; the engine core then takes the smallest count over its
ranks."""

from __future__ import annotations

import torch

from trillm.attention.kv_layout import KVCacheLayout
from trillm.config import TrillmConfig
from trillm.distributed.sharding import RankShapes
from trillm.utils import cdiv

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# CacheConfig.cache_dtype -> the KV cache tensors' dtype (fp8: x / scale, scale 1.0).
_KV_CACHE_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}


class KVCacheTooSmallError(ValueError):
    """The KV cache budget cannot hold even one max_model_len request."""


def kv_cache_dtype(config: TrillmConfig) -> torch.dtype:
    """The KV cache's element dtype: ``--kv-cache-dtype``, or the model's with ``auto``."""
    cache_dtype = config.cache.cache_dtype
    return _KV_CACHE_TORCH_DTYPES[config.model.dtype if cache_dtype == "auto" else cache_dtype]


def block_bytes(
    config: TrillmConfig,
    num_layers: int,
    layout: KVCacheLayout,
    kv_dtype: torch.dtype,
    draft: int,
) -> int:
    """Bytes of one block: ``block_size`` tokens of the model's per-layer ``layout`` (K and V
    of this rank's KV heads; MLA's latent) over ``num_layers`` layers, plus ``draft`` (the
    draft model's bytes a block, 0 without one)."""
    per_token = num_layers * layout.elements_per_token
    return per_token * config.cache.block_size * kv_dtype.itemsize + draft


def num_blocks(
    config: TrillmConfig,
    block_bytes: int,
    device: torch.device,
    shapes: RankShapes,
    state_bytes: int = 0,
) -> int:
    """The blocks the budget holds once ``state_bytes`` (a hybrid model's per-request states,
    ``attention/ssm_state.py``) are taken from it; KVCacheTooSmallError when one max_model_len
    request does not fit (naming the flags that change it)."""
    cache, max_model_len = config.cache, config.model.max_model_len
    needed = cdiv(max_model_len, cache.block_size)
    if cache.num_gpu_blocks_override is not None:
        count = cache.num_gpu_blocks_override
    elif block_bytes == 0:  # no attention layer: blocks only count tokens
        count = needed * config.scheduler.max_num_seqs
    elif device.type == "cuda":
        count = max(0, cuda_budget(config, device, shapes) - state_bytes) // block_bytes
    else:
        count = max(0, cache.kv_cache_memory - state_bytes) // block_bytes
    if count < needed:
        states = f" (besides {state_bytes} bytes of --max-num-seqs states)" if state_bytes else ""
        raise KVCacheTooSmallError(
            f"The KV cache holds {count} blocks of {cache.block_size} tokens{states}, but one "
            f"request of max_model_len={max_model_len} needs {needed}; raise --kv-cache-memory "
            "/ --gpu-memory-utilization or lower --max-model-len."
        )
    return int(count)


def cuda_budget(config: TrillmConfig, device: torch.device | str, shapes: RankShapes) -> int:
    """gpu_memory_utilization of the device, minus what is in use now, minus a reserve for one
    step's activations (max_num_batched_tokens rows plus the sampled logits)."""
    free, total = torch.cuda.mem_get_info(device)
    m, sched = config.model, config.scheduler
    width = 4 * m.hidden_size + 3 * shapes.inter_size
    width += (shapes.num_heads + 2 * shapes.num_kv_heads) * m.head_dim
    activations = sched.max_num_batched_tokens * width * _DTYPE_BYTES[m.dtype] * 2
    activations += sched.max_num_seqs * m.vocab_size * 4 * 4
    used = total - free
    return max(0, int(total * config.cache.gpu_memory_utilization) - used - activations)
