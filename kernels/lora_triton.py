"""Batched LoRA, Triton kernels (GPU; CPU under ``TRITON_INTERPRET=1``), the contract of
``lora_torch``.

The step's tokens are sorted by adapter slot and each slot's run padded to a multiple of
``BLOCK_M`` (``plan``: pad entries are -1; base-model tokens go to a last run whose tiles the
kernels skip), so every M-tile of tokens uses one adapter and its A / Bt tiles are read once
for the whole tile (Punica's segmented GEMM). ``_shrink_kernel``: ``buf = scale * x @ A^T``
([tile, R]); ``_expand_kernel``: ``y += buf @ Bt``, added in fp32 and rounded once. The plan
depends on the step only, so callers make it once and pass it to every linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fused_moe_triton import align_pairs

BLOCK_M = 16


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    buf_ptr,
    scales_ptr,
    tokens_ptr,
    tile_slot_ptr,
    num_slots,
    in_features,
    rank,
    stride_xt,
    stride_al,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    if slot >= num_slots:  # the base-model tokens' run
        return
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] rank columns
    token = tl.load(tokens_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], -1 = pad
    valid = token >= 0
    token = tl.where(valid, token, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + slot * stride_al
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + token[:, None] * stride_xt + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < in_features),
            other=0.0,
        )
        a = tl.load(
            a_base + rs[None, :] * stride_ar + ks[:, None],
            mask=(rs[None, :] < rank) & (ks[:, None] < in_features),
            other=0.0,
        )  # [BK, BR]
        # fp32 operands: a bf16 value is exact in TF32 too, so TF32 products lose nothing
        acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(scales_ptr + slot)
    tl.store(
        buf_ptr + token[:, None] * rank + rs[None, :],
        acc,
        mask=valid[:, None] & (rs[None, :] < rank),
    )


@triton.jit
def _expand_kernel(
    y_ptr,
    buf_ptr,
    bt_ptr,
    tokens_ptr,
    tile_slot_ptr,
    num_slots,
    out_features,
    rank,
    stride_yt,
    stride_bl,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    if slot >= num_slots:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    token = tl.load(tokens_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = token >= 0
    token = tl.where(valid, token, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = bt_ptr + slot * stride_bl
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        c = tl.load(
            buf_ptr + token[:, None] * rank + rs[None, :],
            mask=valid[:, None] & (rs[None, :] < rank),
            other=0.0,
        )  # [BM, BR] fp32
        w = tl.load(
            b_base + rs[:, None] * stride_br + cols[None, :],
            mask=(rs[:, None] < rank) & (cols[None, :] < out_features),
            other=0.0,
        )
        acc = tl.dot(c, w.to(tl.float32), acc, input_precision=DOT_PRECISION)
    mask = valid[:, None] & (cols[None, :] < out_features)
    y_at = y_ptr + token[:, None] * stride_yt + cols[None, :]
    y = tl.load(y_at, mask=mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


@dataclass(frozen=True)
class Plan:
    tokens: torch.Tensor  # [num_tiles * BLOCK_M] int32: tokens sorted by slot, runs padded by -1
    tile_slot: torch.Tensor  # [num_tiles] int32; num_slots for the base-model tokens' tiles
    num_slots: int


def plan(slots: torch.Tensor, num_slots: int) -> Plan:
    """slots [T] int64 (-1 = no adapter) -> the tiles of one adapter each (see the module)."""
    bucket = torch.where(slots >= 0, slots, num_slots)  # base-model tokens sort last
    # one "expert" per token (k = 1): the pair index is the token index
    tokens, tile_slot = align_pairs(bucket.view(-1, 1), num_slots + 1, BLOCK_M)
    return Plan(tokens, tile_slot, num_slots)


_last_plan: tuple[torch.Tensor, Plan] | None = None  # (slots, its plan): see step_plan


def step_plan(slots: torch.Tensor, num_slots: int) -> Plan:
    """``plan(slots, num_slots)``, made once per step: every linear of a forward passes the
    same ``slots`` tensor (the LoRA manager makes a new one per step and never writes it)."""
    global _last_plan
    if _last_plan is None or _last_plan[0] is not slots or _last_plan[1].num_slots != num_slots:
        _last_plan = (slots, plan(slots, num_slots))
    return _last_plan[1]


def _precision(dtype: torch.dtype) -> str:
    """The dots take fp32 operands: IEEE for fp32 models; TF32 for bf16 ones (a bf16 value is
    exact in TF32, so the shrink's products lose nothing)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [L, R, in]
    slots: torch.Tensor,  # [T] int64
    scales: torch.Tensor,  # [L] fp32
    step_plan: Plan | None = None,
    block_r: int = 16,
    block_k: int = 32,
) -> torch.Tensor:  # [T, R] fp32
    num_slots, rank, in_features = a.shape
    buf = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return buf
    p = step_plan or plan(slots, num_slots)
    x, a = x.contiguous(), a.contiguous()
    scales = scales.to(device=x.device, dtype=torch.float32).contiguous()
    _shrink_kernel[(len(p.tile_slot), triton.cdiv(rank, block_r))](
        x,
        a,
        buf,
        scales,
        p.tokens,
        p.tile_slot,
        num_slots,
        in_features,
        rank,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        DOT_PRECISION=_precision(x.dtype),
    )
    return buf


def expand_(
    y: torch.Tensor,  # [T, out], rows contiguous; updated in place
    buf: torch.Tensor,  # [T, R] fp32
    bt: torch.Tensor,  # [L, R, out]
    slots: torch.Tensor,  # [T] int64
    step_plan: Plan | None = None,
    block_n: int = 32,
    block_r: int = 16,
) -> torch.Tensor:
    num_slots, rank, out_features = bt.shape
    if y.shape[0] == 0:
        return y
    if y.stride(1) != 1:
        raise ValueError("y's rows must be contiguous.")
    p = step_plan or plan(slots, num_slots)
    bt, buf = bt.contiguous(), buf.contiguous()
    _expand_kernel[(len(p.tile_slot), triton.cdiv(out_features, block_n))](
        y,
        buf,
        bt,
        p.tokens,
        p.tile_slot,
        num_slots,
        out_features,
        rank,
        y.stride(0),
        bt.stride(0),
        bt.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        DOT_PRECISION=_precision(y.dtype),
    )
    return y


def add_lora_(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [L, R, in]
    bt: torch.Tensor,  # [L, R, out]
    slots: torch.Tensor,  # [T] int64
    scales: torch.Tensor,  # [L] fp32
    step_plan: Plan | None = None,
) -> torch.Tensor:
    p = step_plan or plan(slots, a.shape[0])
    return expand_(y, shrink(x, a, slots, scales, p), bt, slots, p)
