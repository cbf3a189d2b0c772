"""RMSNorm as HF LlamaRMSNorm computes it (fp32, cast back), via ``trillm.kernels.dispatch``,
optionally with the residual add before it fused in."""

from __future__ import annotations

import torch
from torch import nn

from trillm.kernels import rms_norm_torch
from trillm.kernels.dispatch import fused_add_rms_norm_, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # numerics="transformers": HF's own ops (rms_norm_torch), the residual add apart.
        self.reference = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:  # [..., hidden] -> same
        """``norm(x)``; with a residual, in place: ``residual += x``, then ``x = norm(residual)``
        (x is returned)."""
        if self.reference:
            if residual is not None:
                residual.add_(x)
                x.copy_(rms_norm_torch.rms_norm(residual, self.weight, self.eps))
                return x
            return rms_norm_torch.rms_norm(x, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm_(x, residual, self.weight, self.eps)
