"""SiLU-and-multiply on CPU: the native kernel of ``ext/cpu_ops.cpp``, the contract of
``activation_torch.silu_and_mul`` (``silu(gate) * up`` with silu rounded to the dtype first) in
one pass over each row, without the silu temporary.

fp32 and bf16 (math in fp32). ``available()`` is False when the extension is not built or
``TRILLM_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import torch

from . import recording
from ._cpu_ops import DTYPES, extension, num_threads, require, rows


def available() -> bool:
    return extension() is not None


def supports(gate_up: torch.Tensor) -> bool:
    """Whether the kernel handles it: CPU, fp32 or bf16, 1 to 3 dims, contiguous in the last."""
    return (
        gate_up.is_cpu
        and gate_up.dtype in DTYPES
        and 1 <= gate_up.dim() <= 3
        and gate_up.stride(-1) == 1
    )


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [..., 2I] (gate, then up; rows may be strided) -> silu(gate) * up [..., I],
    written into ``out`` when given (same dtype, contiguous in its last dim)."""
    if not supports(gate_up):
        raise ValueError(
            "activation_cpu needs a CPU fp32 or bf16 gate_up of 1 to 3 dims, contiguous in the "
            "last one."
        )
    width = gate_up.shape[-1] // 2
    if width == 0 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(f"gate_up's last dim ({gate_up.shape[-1]}) must be even and positive.")
    shape = (*gate_up.shape[:-1], width)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype)
    elif (
        tuple(out.shape) != shape
        or out.dtype != gate_up.dtype
        or not out.is_cpu
        or out.stride(-1) != 1
    ):
        raise ValueError(
            f"out must be a CPU {gate_up.dtype} tensor of shape {shape}, contiguous in its last "
            f"dim; got {out.dtype} {tuple(out.shape)}."
        )
    recording.call(
        require().silu_and_mul,
        out=rows(out),
        gate_up=rows(gate_up),
        num_rows=out.numel() // width,
        width=width,
        dtype=DTYPES[gate_up.dtype],
        num_threads=num_threads(),
    )
    return out
