"""Linear layers on CPU through the native packed-weight GEMM (``kernels/linear_cpu.py``).

``pack_cpu_linears(model)`` runs once after the weights are loaded: every fp32 CPU
``nn.Linear`` of the model (``StackedLinear`` included) gets a packed copy of its weight and a
forward that multiplies by it when the input has at most ``PACKED_MAX_ROWS`` rows (decode steps
and small prefill chunks; larger inputs keep torch's GEMM). The original weight stays (the tied embedding, state dicts and
non-CPU inputs use it), so the linear weights take twice their memory on CPU. Weights written
after packing are not seen: pack again.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from trillm.kernels import linear_cpu

# Up to this many rows the packed GEMM runs; above, torch's: on the bench model's shapes with 2
# threads the packed one is 1.3-1.7x faster at 8-96 rows, equal at 256, and torch's (which
# blocks over rows and scales better on two cores) equal or faster at 2048.
PACKED_MAX_ROWS = 256


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed: linear_cpu.PackedWeight = self.packed_weight  # type: ignore[assignment]
    if (
        x.numel() <= PACKED_MAX_ROWS * x.shape[-1]
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
    ):
        return linear_cpu.linear(x, packed, self.bias)
    return F.linear(x, self.weight, self.bias)


def pack_cpu_linears(model: nn.Module) -> int:
    """Route the model's fp32 CPU linear layers through packed weights; -> how many. None when
    the native GEMM is unavailable (not built, ``TRILLM_NO_EXTENSIONS=1``, no AVX2/FMA)."""
    if not linear_cpu.available():
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or not linear_cpu.supports(module.weight.detach()):
            continue
        if module.bias is not None and module.bias.dtype != torch.float32:
            continue
        with torch.no_grad():
            module.packed_weight = linear_cpu.PackedWeight(module.weight.detach())
        module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
        count += 1
    return count
