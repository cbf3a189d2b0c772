"""RMSNorm, torch reference: Hugging Face Llama's numerics (normalise in fp32, cast back, scale)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim.

    x: [..., H], weight: [H] -> [..., H] in x's dtype.
    """
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    # NOTE: like HF, the normalised value is cast back to x's dtype *before* the weight multiply.
    return weight * (x32 * rstd).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``, then ``rms_norm(new_residual)``; new tensors, inputs kept.

    x, residual: [..., H] -> (out [..., H], new_residual [..., H]).
    """
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
