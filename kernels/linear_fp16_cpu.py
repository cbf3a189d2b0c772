"""fp16 linear layers on CPU (``--dtype float16``) through ``ext/cpu_gemm_fp16.cpp``; the
packing and the call shared with its bf16 form (``linear_bf16_avx2_cpu.py``: ``Packed16``,
``linear16``).

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

from trillm._native import native_available

from . import _cpu_ops, recording


@functools.cache
def _ext() -> ModuleType | None:
    """``trillm._ext.cpu_kernels.gemm_fp16`` when built and this CPU has AVX2/FMA/F16C."""
    return _cpu_ops.supported_module("gemm_fp16")


def available() -> bool:
    return native_available("cpu_kernels") and _ext() is not None


def _require() -> ModuleType:
    ext = _ext()
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_kernels is not built or this CPU lacks AVX2/F16C.")
    return ext


_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def supports16(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``weight`` [N, K] can be packed: ``dtype`` on CPU, 2-D, no autograd."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == dtype
        and weight.dim() == 2
        and not weight.requires_grad
    )


def supports(weight: torch.Tensor) -> bool:
    return supports16(weight, torch.float16)


class Packed16:
    """A [N, K] 16-bit weight (``DTYPE``) packed for the kernel: panels of 16 output columns,
    [K][16] each. A copy: later writes to the original are not seen."""

    DTYPE: torch.dtype

    def __init__(self, weight: torch.Tensor) -> None:
        ext = _require()
        if not supports16(weight, self.DTYPE) or weight.stride(1) != 1:
            raise ValueError(
                f"{type(self).__name__} needs a 2-D {_SHORT[self.DTYPE]} CPU weight, "
                "contiguous in its last dim."
            )
        self.out_features, self.in_features = weight.shape
        panels = ext.num_panels(self.out_features)
        self.data = torch.empty(panels * self.in_features * ext.PANEL, dtype=self.DTYPE)
        ext.pack(
            weight.data_ptr(),
            self.out_features,
            self.in_features,
            weight.stride(0),
            self.data.data_ptr(),
        )

    def unpack(self) -> torch.Tensor:  # [N, K] in DTYPE, a new tensor
        """The weight back from its panels, exactly (for torch's GEMM off the kernel's path)."""
        panels = self.data.view(-1, self.in_features, _require().PANEL)  # [P, K, 16]
        return panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].clone()


class PackedWeightFp16(Packed16):
    """An fp16 weight packed for ``linear_fp16``."""

    DTYPE = torch.float16


def linear16(
    x: torch.Tensor,  # [..., K] in the weight's dtype, CPU
    weight: Packed16,
    bias: torch.Tensor | None,  # [N] fp32, added to the fp32 sums
    kernel: str,  # the extension's function for this format: "linear" | "linear_bf16"
    name: str,  # for the errors
) -> torch.Tensor:  # [..., N] in the weight's dtype
    """``x @ W^T + bias``, products summed in fp32, each output rounded once."""
    ext = _require()
    n, k, dtype = weight.out_features, weight.in_features, weight.DTYPE
    if x.device.type != "cpu" or x.dtype != dtype or x.shape[-1] != k:
        raise ValueError(f"{name}: x must be {_SHORT[dtype]} on CPU with last dim {k}.")
    if bias is not None and (
        bias.shape != (n,) or bias.dtype != torch.float32 or bias.device.type != "cpu"
    ):
        raise ValueError(f"{name}: bias must be fp32 [{n}] on CPU.")
    rows = x.reshape(-1, k)  # a view when the leading dims allow it, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=dtype)
    recording.call(
        getattr(ext, kernel),
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


def linear_fp16(
    x: torch.Tensor,  # [..., K] fp16 CPU
    weight: PackedWeightFp16,
    bias: torch.Tensor | None = None,  # [N] fp32, added to the fp32 sums
) -> torch.Tensor:  # [..., N] fp16
    """``x @ W^T + bias`` with W fp16 packed, products summed in fp32, rounded to fp16 once."""
    return linear16(x, weight, bias, "linear", "linear_fp16")
