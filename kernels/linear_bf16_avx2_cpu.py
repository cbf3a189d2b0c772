"""bf16 linear layers on CPUs without AVX512-BF16, through ``ext/cpu_gemm_fp16.cpp``'s kernel
templated over the 16-bit format (``linear_bf16``).

Weights stay bf16 (packed once as the fp16 kernel packs: panels of 16 output columns, [K][16]
each); weights and activations are widened to fp32 in registers (a 16-bit shift, exact),
products summed in fp32 and each output rounded to bf16 once (round to nearest even): torch's
bf16 ``F.linear`` numerics up to summation order. Why: without AVX512-BF16 torch's bf16 GEMM on
CPU ran ~21 GFLOP/s where its fp32 one ran ~150 (benchmarks/serving/speed_1b.py, Llama-3.2-1B
shape), and widening the weights to fp32 once would double their memory. Where the AVX512-BF16
kernel exists (``linear_cpu.available_bf16()``) it is used instead (``layers/linear.py``).
``available()`` is False when the extension is not built, ``TRILLM_NO_EXTENSIONS=1``, or the CPU
lacks AVX2/FMA/F16C; callers then keep ``F.linear``.
"""

from __future__ import annotations

import torch

from . import linear_fp16_cpu
from .linear_fp16_cpu import Packed16, linear16


def available() -> bool:
    return linear_fp16_cpu.available()


def supports(weight: torch.Tensor) -> bool:
    return linear_fp16_cpu.supports16(weight, torch.bfloat16)


class PackedWeightBf16Avx2(Packed16):
    """A bf16 weight packed for ``linear_bf16`` (the fp16 kernel's layout)."""

    DTYPE = torch.bfloat16


def linear_bf16(
    x: torch.Tensor,  # [..., K] bf16 CPU
    weight: PackedWeightBf16Avx2,
    bias: torch.Tensor | None = None,  # [N] fp32, added to the fp32 sums
) -> torch.Tensor:  # [..., N] bf16
    """``x @ W^T + bias`` with W bf16 packed, products summed in fp32, rounded to bf16 once."""
    return linear16(x, weight, bias, "linear_bf16", "linear_bf16 (AVX2)")
