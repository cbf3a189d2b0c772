"""Write this step's keys/values into the paged KV cache, torch reference."""

from __future__ import annotations

import torch


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset
) -> None:
    """In place: row t goes to slot ``slot_mapping[t]``; rows with a negative slot (padding)
    are skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(kv_cache.dtype)
