"""Rotary embedding on CPU: the native kernel of ``ext/cpu_ops.cpp``, the rotation of
``rotary_torch`` (neox / HF ``rotate_half``, fp32 math, cast back) done in place on q and k, which
may be strided views of one fused qkv buffer: each head is read and written once.

fp32 and bf16 q/k, an fp32 cos|sin cache. Positions outside the cache raise ValueError.
``available()`` is False when the extension is not built or ``TRILLM_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import torch

from . import recording
from ._cpu_ops import DTYPES, extension, num_threads, require, rows


def available() -> bool:
    return extension() is not None


def supports(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> bool:
    """Whether the kernel handles these tensors: CPU, q and k [T, H, D] fp32 or bf16 of one dtype
    and contiguous in their last dim, an fp32 [max_pos, rotary_dim] cache contiguous in its last
    dim, integer positions."""
    return (
        q.is_cpu
        and k.is_cpu
        and positions.is_cpu
        and cos_sin_cache.is_cpu
        and q.dtype in DTYPES
        and k.dtype == q.dtype
        and q.dim() == 3
        and k.dim() == 3
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.stride(-1) == 1
        and not positions.is_floating_point()
        and not positions.is_complex()
    )


def apply_rotary_(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim] fp32: cos half, then sin half
) -> None:
    """Rotate the first rotary_dim dims of each head of q and k **in place** by the positions;
    dims ``rotary_dim .. D`` are left as they are."""
    if not supports(q, k, positions, cos_sin_cache):
        raise ValueError(
            "rotary_cpu needs CPU tensors: q and k [T, H, D] fp32 or bf16 of one dtype, contiguous "
            "in their last dim, integer positions and an fp32 [max_pos, rotary_dim] cache."
        )
    num_tokens, _, head_dim = q.shape
    rotary_dim = cos_sin_cache.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} "
            "disagree on the tokens or the head size."
        )
    if rotary_dim == 0 or rotary_dim % 2 != 0 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even, positive and <= {head_dim}.")
    if num_tokens == 0:
        return
    positions = positions.to(torch.int64).contiguous()
    recording.call(
        require().rotary,
        q=rows(q),
        k=rows(k),
        positions=positions.data_ptr(),
        cos_sin_cache=cos_sin_cache.data_ptr(),
        num_tokens=num_tokens,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        max_pos=cos_sin_cache.shape[0],
        cache_stride=cos_sin_cache.stride(0),
        dtype=DTYPES[q.dtype],
        num_threads=num_threads(),
    )
