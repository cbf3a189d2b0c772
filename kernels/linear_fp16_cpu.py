"""fp16 linear layers on CPU (``--dtype float16``) through ``ext/cpu_gemm_fp16.cpp``.

Weights stay fp16 (packed once in panels of 16 output columns, [K][16] each, the fp32 GEMM's
layout); F16C widens weights and activations to fp32 in registers, products are summed in fp32
and each output rounded to fp16 once: torch's fp16 ``F.linear`` numerics up to summation order
(the reference is ``F.linear`` on the same fp16 values in fp32, rounded to fp16). Why: torch's
fp16 GEMM on a CPU without AVX512-FP16 is a generic kernel, several times slower than fp32 once
a call has more than a few rows. ``available()`` is False when the extension is not built,
``TRILLM_NO_EXTENSIONS=1``, or the CPU lacks AVX2/FMA/F16C; callers then keep ``F.linear``.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from trillm._native import cpu_kernels, native_available

from . import recording


@functools.cache
def _ext() -> ModuleType | None:
    """``trillm._ext.cpu_kernels.gemm_fp16`` when built and this CPU has AVX2/FMA/F16C."""
    ext = cpu_kernels("gemm_fp16")
    return ext if ext is not None and ext.supported() else None


def available() -> bool:
    return native_available("cpu_kernels") and _ext() is not None


def _require() -> ModuleType:
    ext = _ext()
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_kernels is not built or this CPU lacks F16C.")
    return ext


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [N, K] can be packed: fp16 on CPU, 2-D, no autograd."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float16
        and weight.dim() == 2
        and not weight.requires_grad
    )


class PackedWeightFp16:
    """A [N, K] fp16 weight packed for ``linear_fp16`` (a copy: later writes to the original
    are not seen)."""

    def __init__(self, weight: torch.Tensor) -> None:
        ext = _require()
        if not supports(weight) or weight.stride(1) != 1:
            raise ValueError(
                "PackedWeightFp16 needs a 2-D fp16 CPU weight, contiguous in its last dim."
            )
        self.out_features, self.in_features = weight.shape
        panels = ext.num_panels(self.out_features)
        self.data = torch.empty(panels * self.in_features * ext.PANEL, dtype=torch.float16)
        ext.pack(
            weight.data_ptr(),
            self.out_features,
            self.in_features,
            weight.stride(0),
            self.data.data_ptr(),
        )


def linear_fp16(
    x: torch.Tensor,  # [..., K] fp16 CPU
    weight: PackedWeightFp16,
    bias: torch.Tensor | None = None,  # [N] fp32, added to the fp32 sums
) -> torch.Tensor:  # [..., N] fp16
    """``x @ W^T + bias`` with W fp16 packed, products summed in fp32, rounded to fp16 once."""
    ext = _require()
    n, k = weight.out_features, weight.in_features
    if x.device.type != "cpu" or x.dtype != torch.float16 or x.shape[-1] != k:
        raise ValueError(f"linear_fp16: x must be fp16 on CPU with last dim {k}.")
    if bias is not None and (
        bias.shape != (n,) or bias.dtype != torch.float32 or bias.device.type != "cpu"
    ):
        raise ValueError(f"linear_fp16: bias must be fp32 [{n}] on CPU.")
    rows = x.reshape(-1, k)  # a view when the leading dims allow it, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float16)
    recording.call(
        ext.linear,
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
