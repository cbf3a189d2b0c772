"""Write this step's keys/values into the paged KV cache on CPU: the native kernel of
``ext/cpu_ops.cpp``, the contract of ``reshape_and_cache_torch.reshape_and_cache`` (row t to
slot ``slot_mapping[t]``, negative slots skipped) as one row copy per token and head.

Why not ``index_copy_``: on CPU each call is a parallel torch op that wakes torch's idle OpenMP
threads while the native kernels' pool holds the cores (two calls a layer: ~0.65 ms of a
batch-53 decode step). fp32 and bf16, k, v and the cache of one dtype, or an fp8 e4m3 cache
(``--kv-cache-dtype fp8``). ``available()`` is False
when the extension is not built or ``TRILLM_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import torch

from . import recording
from ._cpu_ops import DTYPES, extension, num_threads, require, rows


def available() -> bool:
    return extension() is not None


def supports(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors: CPU, fp32 or bf16, one dtype (or an fp8 e4m3
    cache: values rounded to e4m3, saturating at +-448, scale 1.0), k and v
    [T, Hkv, D] contiguous in the last dim, a contiguous cache [2, blocks, block_size, Hkv, D]."""
    return (
        k.is_cpu
        and v.is_cpu
        and kv_cache.is_cpu
        and k.dtype in DTYPES
        and v.dtype == k.dtype
        and kv_cache.dtype in (k.dtype, torch.float8_e4m3fn)
        and k.dim() == 3
        and k.shape == v.shape
        and kv_cache.dim() == 5
        and kv_cache.shape[0] == 2
        and tuple(k.shape[1:]) == tuple(kv_cache.shape[3:])
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and kv_cache.is_contiguous()
    )


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D], rows may be strided (a view of a fused qkv)
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset; < 0: skipped
) -> None:
    """In place, like ``reshape_and_cache_torch.reshape_and_cache``."""
    if not supports(k, v, kv_cache):
        raise ValueError(
            "reshape_and_cache_cpu needs CPU fp32/bf16 k, v [T, Hkv, D] (contiguous last dim) "
            "and a contiguous cache [2, blocks, block_size, Hkv, D] of the same dtype or fp8."
        )
    if (
        slot_mapping.dtype != torch.int64
        or not slot_mapping.is_cpu
        or slot_mapping.shape != (k.shape[0],)
        or slot_mapping.stride(0) != 1
    ):
        raise ValueError("slot_mapping must be a contiguous CPU int64 tensor [T].")
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    recording.call(
        require().reshape_and_cache,
        k=rows(k),
        v=rows(v),
        key_cache=kv_cache[0].data_ptr(),
        value_cache=kv_cache[1].data_ptr(),
        slot_mapping=slot_mapping.data_ptr(),
        num_tokens=k.shape[0],
        head_dim=k.shape[2],
        num_slots=num_slots,
        dtype=DTYPES[k.dtype],
        num_threads=num_threads(),
        cache_fp8=kv_cache.dtype == torch.float8_e4m3fn,
    )
