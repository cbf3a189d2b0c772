"""Linear layers on CPU through the native packed-weight GEMM (``kernels/linear_cpu.py``).

``pack_cpu_linears(model)`` runs once after the weights are loaded: every fp32 CPU
``nn.Linear`` of the model (``StackedLinear`` included) gets a packed copy of its weight and a
forward that multiplies by it (inference only: with autograd on, torch's GEMM on the weight).
On the bench model's shapes with 2 threads it runs 1.3-1.7x torch's GEMM at 8-96 rows (decode
steps) and 1.1-1.2x at 512-4096 (prefill chunks). The original weight stays (the tied
embedding, state dicts and non-CPU inputs use it), so the linear weights take twice their
memory on CPU. Weights written after packing are not seen: pack again.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from trillm.kernels import linear_cpu


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed: linear_cpu.PackedWeight = self.packed_weight  # type: ignore[assignment]
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled():
        return linear_cpu.linear(x, packed, self.bias)
    return F.linear(x, self.weight, self.bias)


def pack_cpu_linears(model: nn.Module) -> int:
    """Route the model's fp32 CPU linear layers through packed weights; -> how many: 0 when
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
