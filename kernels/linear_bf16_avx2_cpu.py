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

from types import ModuleType

import torch

from . import linear_fp16_cpu, recording


def available() -> bool:
    return linear_fp16_cpu.available()


def _require() -> ModuleType:
    ext = linear_fp16_cpu._ext()
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_kernels is not built or this CPU lacks AVX2/F16C.")
    return ext


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [N, K] can be packed: bf16 on CPU, 2-D, no autograd."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not weight.requires_grad
    )


class PackedWeightBf16Avx2:
    """A [N, K] bf16 weight packed for ``linear_bf16`` (a copy: later writes to the original
    are not seen)."""

    def __init__(self, weight: torch.Tensor) -> None:
        ext = _require()
        if not supports(weight) or weight.stride(1) != 1:
            raise ValueError(
                "PackedWeightBf16Avx2 needs a 2-D bf16 CPU weight, contiguous in its last dim."
            )
        self.out_features, self.in_features = weight.shape
        panels = ext.num_panels(self.out_features)
        self.data = torch.empty(panels * self.in_features * ext.PANEL, dtype=torch.bfloat16)
        ext.pack(
            weight.data_ptr(),
            self.out_features,
            self.in_features,
            weight.stride(0),
            self.data.data_ptr(),
        )


def linear_bf16(
    x: torch.Tensor,  # [..., K] bf16 CPU
    weight: PackedWeightBf16Avx2,
    bias: torch.Tensor | None = None,  # [N] fp32, added to the fp32 sums
) -> torch.Tensor:  # [..., N] bf16
    """``x @ W^T + bias`` with W bf16 packed, products summed in fp32, rounded to bf16 once."""
    ext = _require()
    n, k = weight.out_features, weight.in_features
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.shape[-1] != k:
        raise ValueError(f"linear_bf16 (AVX2): x must be bf16 on CPU with last dim {k}.")
    if bias is not None and (
        bias.shape != (n,) or bias.dtype != torch.float32 or bias.device.type != "cpu"
    ):
        raise ValueError(f"linear_bf16 (AVX2): bias must be fp32 [{n}] on CPU.")
    rows = x.reshape(-1, k)  # a view when the leading dims allow it, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    recording.call(
        ext.linear_bf16,
        rows.data_ptr(),
        rows.shape[0],
        k,
        rows.stride(0),
        weight.data.data_ptr(),
        n,
        0 if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)
