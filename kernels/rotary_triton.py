"""Rotary position embedding (neox / HF ``rotate_half`` style), Triton kernel, in place.

One program per token rotates all its query and key heads: a [heads, rotary_dim/2] tile per
half, fp32 math, result cast back to the tensor's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_t,
    stride_h,
    token,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first = x_ptr + token * stride_t + heads * stride_h + dims  # [BLOCK_HEADS, BLOCK_HALF]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + dims, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + dims, mask=dmask, other=0.0)
    cos = cos[None, :]
    sin = sin.to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr, stride_qt, stride_qh, token, num_q_heads, cos, sin, HALF, BLOCK_QH, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr, stride_kt, stride_kh, token, num_k_heads, cos, sin, HALF, BLOCK_KH, BLOCK_HALF
    )


def apply_rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] **in place** by positions [T].

    ``cos_sin_cache``: [max_pos, rotary_dim] (cos half, sin half), rotary_dim <= D, even.
    q and k may be strided views (e.g. slices of a fused qkv output) but need a unit last stride.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 != 0 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}.")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("apply_rotary_ needs a unit stride on the last dim of q, k and the cache.")
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        k.shape[1],
        HALF=rotary_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
    )


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place form of ``apply_rotary_``: returns rotated copies, inputs untouched."""
    q_out, k_out = q.clone(), k.clone()
    apply_rotary_(q_out, k_out, positions, cos_sin_cache)
    return q_out, k_out
