"""Mixture-of-experts FFN, the torch reference: every routed (token, expert) pair computes
``down_e(silu(gate_e(x)) * up_e(x))`` scaled by its routing weight, summed per token.

Layouts (Hugging Face's fused expert tensors): ``w13`` [E, 2I, H] holds each expert's gate rows
then its up rows; ``w2`` [E, H, I] its down projection. ``topk_ids`` / ``topk_weights``
[T, k]: the experts each token is routed to and their weights (``select_experts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, ids [T, k] int64
    """Softmax over the experts in fp32, the ``top_k`` largest, renormalized to sum to 1 when
    the model says so (Mixtral always; Qwen MoE by ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for expert in torch.unique(topk_ids).tolist():
        tokens, slot = torch.where(topk_ids == expert)
        gate_up = F.linear(x[tokens], w13[expert])  # [n, 2I]
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        y = F.linear(hidden, w2[expert])  # [n, H]
        out.index_add_(0, tokens, y * topk_weights[tokens, slot, None].to(y.dtype))
    return out
