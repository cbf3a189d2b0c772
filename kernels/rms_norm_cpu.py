"""RMSNorm on CPU: the native kernels of ``ext/cpu_ops.cpp``, with the numerics of
``rms_norm_torch`` (fp32 math, the normalised value cast back to x's dtype before the weight
multiply) in one pass per row instead of one torch op per step of the formula.

``fused_add_rms_norm_`` is the in-place form the model uses between layers: the residual add and
the norm of the sum in one pass, no new tensors. fp32 and bf16; x, residual and weight share a
dtype. ``available()`` is False when the extension is not built or ``TRILLM_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import torch

from . import recording
from ._cpu_ops import DTYPES, extension, num_threads, require, rows


def available() -> bool:
    return extension() is not None


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the kernels handle these tensors: CPU, fp32 or bf16, one dtype, x (and a residual
    of its shape) of 1 to 3 dims contiguous in the last one, a contiguous weight [H]."""
    # NOTE: asked on every call of the dispatch: plain attribute checks, cheapest first.
    if residual is not None and not (
        residual.is_cpu
        and residual.dtype == x.dtype
        and residual.shape == x.shape
        and residual.stride(-1) == 1
    ):
        return False
    return (
        x.is_cpu
        and weight.is_cpu
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and 1 <= x.dim() <= 3
        and x.stride(-1) == 1
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1] > 0
        and weight.is_contiguous()
    )


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> int:
    """The hidden size, once the tensors are known to fit the kernels."""
    if not supports(x, weight, residual):
        raise ValueError(
            "rms_norm_cpu needs CPU fp32 or bf16 tensors of one dtype: x [..., H] (1 to 3 dims, "
            "contiguous in the last), a residual of x's shape, a contiguous weight [H]; got x "
            f"{x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}."
        )
    return x.shape[-1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] (rows may be strided), weight: [H] -> a new contiguous [..., H]."""
    hidden = _check(x, weight)
    out = torch.empty_like(x)  # x's layout when dense, else contiguous
    recording.call(
        require().rms_norm,
        out=rows(out),
        x=rows(x),
        weight=weight.data_ptr(),
        num_rows=x.numel() // hidden,
        hidden=hidden,
        eps=eps,
        dtype=DTYPES[x.dtype],
        num_threads=num_threads(),
    )
    return out


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual = x + residual`` (rounded to the dtype, as torch's add), then
    ``x = rms_norm(residual)``. x, residual: [..., H], rows may be strided."""
    hidden = _check(x, weight, residual)
    recording.call(
        require().fused_add_rms_norm,
        x=rows(x),
        residual=rows(residual),
        weight=weight.data_ptr(),
        num_rows=x.numel() // hidden,
        hidden=hidden,
        eps=eps,
        dtype=DTYPES[x.dtype],
        num_threads=num_threads(),
    )
