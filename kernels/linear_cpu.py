"""fp32 linear layers on CPU through the native GEMM of ``ext/cpu_gemm.cpp``: the weight is
packed once (panels of 16 output columns, [K][16] each) and every call reads it in that layout,
instead of torch's sgemm packing it again on each call -- most of the cost at decode-step row
counts. Same contract as ``torch.nn.functional.linear`` for fp32 CPU tensors; the torch
reference is that function itself.

``available()`` is False when the extension is not built, ``TRILLM_NO_EXTENSIONS=1``, or the CPU
lacks AVX2/FMA; callers then keep ``F.linear``.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from trillm._native import cpu_kernels, native_available


@functools.cache
def _ext() -> ModuleType | None:
    """``trillm._ext.cpu_kernels.gemm`` when built and this CPU has AVX2/FMA, else None; looked
    up once (``linear`` runs for every layer of every step)."""
    ext = cpu_kernels("gemm")
    return ext if ext is not None and ext.supported() else None


def available() -> bool:
    return native_available("cpu_kernels") and _ext() is not None


def _require() -> ModuleType:
    ext = _ext()
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_kernels is not built or this CPU lacks AVX2/FMA.")
    return ext


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [N, K] can be packed: fp32 on CPU, 2-D, no autograd."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.requires_grad
    )


class PackedWeight:
    """A [N, K] fp32 weight packed for ``linear``. A copy: later writes to the original are not
    seen (pack again after reloading weights)."""

    def __init__(self, weight: torch.Tensor) -> None:
        ext = _require()
        if not supports(weight) or weight.stride(1) != 1:
            raise ValueError(
                "PackedWeight needs a 2-D fp32 CPU weight, contiguous in its last dim."
            )
        self.out_features, self.in_features = weight.shape
        panels = ext.num_panels(self.out_features)
        self.data = torch.empty(panels * self.in_features * ext.PANEL, dtype=torch.float32)
        ext.pack(
            weight.data_ptr(), self.out_features, self.in_features, weight.stride(0),
            self.data.data_ptr(),
        )  # fmt: skip


def linear(
    x: torch.Tensor,  # [..., K] fp32 CPU
    weight: PackedWeight,
    bias: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:  # [..., N]
    """``x @ W^T + bias`` with W packed. Rows of x may be strided (last dim contiguous)."""
    ext = _require()
    n, k = weight.out_features, weight.in_features
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[-1] != k:
        raise ValueError(f"linear_cpu.linear: x must be fp32 on CPU with last dim {k}.")
    if bias is not None and (
        bias.shape != (n,) or bias.dtype != torch.float32 or bias.device.type != "cpu"
    ):
        raise ValueError(f"linear_cpu.linear: bias must be fp32 [{n}] on CPU.")
    rows = x.reshape(-1, k)  # a view when the leading dims allow it, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    bias_ptr = 0 if bias is None else bias.contiguous().data_ptr()
    ext.linear(
        rows.data_ptr(), rows.shape[0], k, rows.stride(0), weight.data.data_ptr(), n, bias_ptr,
        out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
