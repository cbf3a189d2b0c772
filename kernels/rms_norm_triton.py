"""RMSNorm, Triton kernel: one program per row, the whole row in one block (fp32 math)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,  # residual in, only read when HAS_RESIDUAL
    out_ptr,
    new_res_ptr,  # x + residual out, only written when HAS_RESIDUAL
    w_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_new_res,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        # NOTE: the sum is rounded to x's dtype first, as `x + residual` in torch would be.
        x = x + res
        tl.store(new_res_ptr + row * stride_new_res + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, normed * w, mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [T, H]
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x, residual, weight, eps):
    x2 = _as_rows(x)
    num_rows, hidden = x2.shape
    out = torch.empty_like(x2)
    res2 = _as_rows(residual) if residual is not None else x2
    new_res = torch.empty_like(x2) if residual is not None else out
    block_h = triton.next_power_of_2(hidden)
    if num_rows > 0:
        _rms_norm_kernel[(num_rows,)](
            x2,
            res2,
            out,
            new_res,
            weight,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            new_res.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h,
            num_warps=min(max(block_h // 512, 1), 16),  # about 16 elements per thread
        )
    return out.view(x.shape), new_res.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H]; same numerics as ``rms_norm_torch.rms_norm``."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual); new tensors, the inputs are not modified."""
    return _launch(x, residual, weight, eps)
