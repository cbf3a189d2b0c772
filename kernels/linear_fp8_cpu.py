"""fp8 (e4m3) weight-only linear layers on CPU: ``--quantization fp8``.

``Fp8Weight.quantize(w)`` turns a [N, K] fp32/bf16 weight into one e4m3 byte a weight and an
fp32 scale per output channel (``scale = absmax(row) / 448``, e4m3's largest finite value; a
row of zeros gets scale 1), rounded to nearest even by torch's ``float8_e4m3fn`` cast, and packs
the bytes for ``ext/cpu_gemm_fp8.cpp`` (the bf16 GEMM's layout with bytes: panels of 64 output
columns, [K/2][64][2]). The packing is plain torch, so one format serves every CPU.

``linear_fp8(x, w, bias)`` is ``x @ (bytes * scale)^T + bias``: on a CPU with AVX512-BF16 the
native kernel widens the bytes to bf16 in registers (exact) and sums the products with
``vdpbf16ps`` in fp32, x rounded to bf16 first when it is fp32; elsewhere (no extension,
``TRILLM_NO_EXTENSIONS=1``, no AVX512-BF16) the portable path dequantizes to x's dtype and calls
``F.linear``. The reference for both is ``F.linear`` on ``w.dequantize()``.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from trillm._native import native_available
from trillm.utils import cdiv

from . import _cpu_ops, recording

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
PANEL = 64  # output columns per packed panel (ext/cpu_gemm_fp8.cpp's kCols)
_IO = (torch.float32, torch.bfloat16)


@functools.cache
def _ext() -> ModuleType | None:
    """``trillm._ext.cpu_kernels.gemm_fp8`` when built and this CPU has AVX512-BF16 (looked up
    once)."""
    return _cpu_ops.supported_module("gemm_fp8")


def kernel_available() -> bool:
    """Whether ``linear_fp8`` runs the native kernel (else the portable dequantize path)."""
    return native_available("cpu_kernels") and _ext() is not None


class Fp8Weight:
    """A [N, K] weight as e4m3 bytes packed in panels (``data``) and fp32 per-channel scales
    (``scale`` [N]). Made by ``quantize``; the source weight is not kept."""

    def __init__(
        self, data: torch.Tensor, scale: torch.Tensor, out_features: int, in_features: int
    ) -> None:
        self.data = data  # [panels, K2 / 2, 64, 2] uint8 (K2 = K rounded up to even)
        self.scale = scale  # [N] fp32
        self.out_features = out_features
        self.in_features = in_features

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        """Per output channel: scale = absmax / 448, bytes = e4m3(w / scale)."""
        if weight.dim() != 2 or weight.dtype not in _IO or weight.device.type != "cpu":
            raise ValueError("Fp8Weight.quantize needs a 2-D fp32 or bf16 CPU weight.")
        n, k = weight.shape
        w = weight.detach().to(torch.float32)
        absmax = w.abs().amax(dim=1)  # [N]
        scale = torch.where(absmax > 0, absmax / E4M3_MAX, torch.ones_like(absmax))
        q = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return cls(_pack(q.view(torch.uint8)), scale.contiguous(), n, k)

    def codes(self) -> torch.Tensor:  # [N, K] uint8: the e4m3 bytes in row order
        panels, pairs = self.data.shape[:2]
        rows = self.data.permute(0, 2, 1, 3).reshape(panels * PANEL, pairs * 2)
        return rows[: self.out_features, : self.in_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        """The weight the layer multiplies by: e4m3 value * scale, in fp32 then ``dtype``."""
        values = self.codes().view(torch.float8_e4m3fn).to(torch.float32)
        return (values * self.scale[:, None]).to(dtype)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 -> [panels, K2 / 2, 64, 2]: zero-padded to whole panels and an even K."""
    n, k = q.shape
    panels, k2 = cdiv(n, PANEL), k + (k & 1)
    padded = torch.zeros(panels * PANEL, k2, dtype=torch.uint8)
    padded[:n, :k] = q
    return padded.view(panels, PANEL, k2 // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_fp8(
    x: torch.Tensor,  # [..., K] fp32 or bf16 CPU
    weight: Fp8Weight,
    bias: torch.Tensor | None = None,  # [N] fp32 (added to the fp32 sums)
) -> torch.Tensor:  # [..., N], x's dtype
    """``x @ W^T + bias`` with W = the dequantized fp8 weight."""
    n, k = weight.out_features, weight.in_features
    if x.device.type != "cpu" or x.dtype not in _IO or x.shape[-1] != k:
        raise ValueError(f"linear_fp8: x must be fp32 or bf16 on CPU with last dim {k}.")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32):
        raise ValueError(f"linear_fp8: bias must be fp32 [{n}].")
    ext = _ext() if native_available("cpu_kernels") else None
    if ext is None or torch.is_grad_enabled():
        out_bias = None if bias is None else bias.to(x.dtype)
        return F.linear(x, weight.dequantize(x.dtype), out_bias)
    rows = x.reshape(-1, k)  # a view when the leading dims allow it, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    recording.call(
        ext.linear,
        rows.data_ptr(),
        rows.dtype == torch.bfloat16,
        rows.shape[0],
        k,
        rows.stride(0),
        weight.data.data_ptr(),
        n,
        weight.scale.data_ptr(),
        0 if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
        out.dtype == torch.bfloat16,
        n,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)
