"""RMSNorm as HF LlamaRMSNorm computes it (fp32, cast back), via ``trillm.kernels``."""

from __future__ import annotations

import torch
from torch import nn

from trillm.kernels import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> same
        return rms_norm(x, self.weight, self.eps)
