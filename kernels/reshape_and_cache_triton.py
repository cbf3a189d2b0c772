"""Write this step's keys/values into the paged KV cache, Triton kernel.

One program per token copies its [Hkv, D] key and value tiles to the token's slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_h,
    num_kv_heads,
    head_dim,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding row
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        dst = slot * stride_cache_slot + heads * stride_cache_h + dims
        key = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        tl.store(k_cache_ptr + dst, key, mask=mask)
        value = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(v_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset
) -> None:
    """In place; same contract as ``reshape_and_cache_torch.reshape_and_cache``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("reshape_and_cache needs a unit stride on the last dim of k and v.")
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
    # NOTE: a (block, offset) slot is one flat index because the block and offset dims of the
    # cache are laid out densely: stride(block) == block_size * stride(offset).
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("reshape_and_cache needs the block and offset dims of the cache dense.")
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
