"""Mixture-of-experts FFN, Triton kernels (GPU; CPU under ``TRITON_INTERPRET=1``).

The (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of
``BLOCK_M`` (pad entries are -1), so every M-tile of pairs belongs to one expert. Two grouped
GEMMs then run tile by tile: ``_gate_up_kernel`` computes ``silu(x @ W1_e^T) * (x @ W3_e^T)``
for a tile of pairs and ``BLOCK_N`` intermediate columns, ``_down_kernel`` multiplies by
``W2_e^T`` and the pair's routing weight. The per-pair rows are then summed per token.
Same layouts and contract as ``fused_moe_torch.fused_moe``; accumulation in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    h_ptr,
    pairs_ptr,
    tile_expert_ptr,
    top_k,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_hp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate columns
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], -1 = pad
    valid = pair >= 0
    token = tl.where(valid, pair // top_k, 0).to(tl.int64)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w13_ptr + expert * stride_we
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + token[:, None] * stride_xt + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < hidden),
            other=0.0,
        )
        wmask = (col[None, :] < inter) & (ks[:, None] < hidden)
        w1 = tl.load(w_base + col[None, :] * stride_wn + ks[:, None], mask=wmask, other=0.0)
        w3 = tl.load(
            w_base + (col[None, :] + inter) * stride_wn + ks[:, None], mask=wmask, other=0.0
        )
        gate = tl.dot(x, w1, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, w3, up, input_precision=DOT_PRECISION)
    # The reference rounds silu and the product to the model's dtype; h keeps fp32 here.
    h = gate / (1.0 + tl.exp(-gate)) * up
    safe_pair = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(
        h_ptr + safe_pair[:, None] * stride_hp + col[None, :],
        h,
        mask=valid[:, None] & (col[None, :] < inter),
    )


@triton.jit
def _down_kernel(
    h_ptr,
    w2_ptr,
    y_ptr,
    weight_ptr,
    pairs_ptr,
    tile_expert_ptr,
    hidden,
    inter,
    stride_hp,
    stride_we,
    stride_wn,
    stride_yp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden columns
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair >= 0
    safe_pair = tl.where(valid, pair, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w2_ptr + expert * stride_we
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(
            h_ptr + safe_pair[:, None] * stride_hp + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < inter),
            other=0.0,
        )
        w = tl.load(
            w_base + col[None, :] * stride_wn + ks[:, None],
            mask=(col[None, :] < hidden) & (ks[:, None] < inter),
            other=0.0,
        )
        acc = tl.dot(h.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
    weight = tl.load(weight_ptr + safe_pair, mask=valid, other=0.0)
    acc = acc * weight[:, None]
    tl.store(
        y_ptr + safe_pair[:, None] * stride_yp + col[None, :],
        acc,
        mask=valid[:, None] & (col[None, :] < hidden),
    )


def align_pairs(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [num_tiles * block_m] int32: pair index t * k + slot sorted by expert, each
    expert's run padded with -1 to a multiple of block_m; tile_expert [num_tiles] int32)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    tiles = (counts + block_m - 1) // block_m  # [E]
    padded = torch.full((int(tiles.sum()) * block_m,), -1, dtype=torch.int32, device=flat.device)
    tile_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device, dtype=torch.int32), tiles
    )
    # Where each expert's run starts in the padded order, and each sorted pair's place in it.
    run_start = torch.cumsum(tiles * block_m, 0) - tiles * block_m  # [E]
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E] in the unpadded order
    rank = torch.arange(len(flat), device=flat.device) - first_of_expert[sorted_experts]
    padded[run_start[sorted_experts] + rank] = order.to(torch.int32)
    return padded, tile_expert


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:  # [T, H]
    num_tokens, hidden = x.shape
    num_experts, _, inter = w2.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    pairs, tile_expert = align_pairs(topk_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    h = torch.empty(num_pairs, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    num_tiles = len(tile_expert)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        x,
        w13,
        h,
        pairs,
        tile_expert,
        top_k,
        hidden,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=precision,
    )
    _down_kernel[(num_tiles, triton.cdiv(hidden, block_n))](
        h,
        w2,
        y,
        weights,
        pairs,
        tile_expert,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=precision,
    )
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
