"""Mixture-of-experts FFN on CPU: the routed (token, expert) pairs grouped by expert, and each
expert's group multiplied at once through the native packed GEMM (``linear_cpu``) and the
native ``silu_and_mul``: two grouped GEMMs per expert that has tokens, instead of one small
matmul per pair. Same layouts and result as ``fused_moe_torch.fused_moe`` (fp32).

``PackedExperts`` packs the expert weights once (the layer does it on first use).
"""

from __future__ import annotations

import torch

from trillm.kernels import linear_cpu, recording
from trillm.kernels.dispatch import silu_and_mul


def available() -> bool:
    return linear_cpu.available()


def supports(x: torch.Tensor, w13: torch.Tensor) -> bool:
    return (
        available()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and w13.dtype == torch.float32
        and not torch.is_grad_enabled()
    )


class PackedExperts:
    """Each expert's gate/up [2I, H] and down [H, I] packed for ``linear_cpu.linear``."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13 = [linear_cpu.PackedWeight(w13[e].contiguous()) for e in range(w13.shape[0])]
        self.w2 = [linear_cpu.PackedWeight(w2[e].contiguous()) for e in range(w2.shape[0])]


def fused_moe(
    x: torch.Tensor,  # [T, H] fp32
    packed: PackedExperts,
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    out = torch.empty_like(x)
    # One opaque call for a step program: the grouping by expert depends on the data.
    recording.opaque(_fused_moe_into, out, x, packed, topk_weights, topk_ids)
    return out


def _fused_moe_into(
    out: torch.Tensor,  # [T, H], written
    x: torch.Tensor,
    packed: PackedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    tokens = order // k  # [T * k] the token of each sorted pair
    weights = topk_weights.reshape(-1)[order].to(x.dtype)
    counts = torch.bincount(flat, minlength=len(packed.w13)).tolist()
    out.zero_()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        gate_up = linear_cpu.linear(x.index_select(0, rows), packed.w13[expert])  # [n, 2I]
        hidden = silu_and_mul(gate_up)  # [n, I]
        y = linear_cpu.linear(hidden, packed.w2[expert])  # [n, H]
        y.mul_(weights[start : start + n, None])
        out.index_add_(0, rows, y)
        start += n
