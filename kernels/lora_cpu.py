"""Batched LoRA on CPU: the native shrink / expand kernels of ``ext/cpu_lora.cpp`` (AVX-512,
with a generic build chosen at run time where the CPU lacks it), with the contract of
``lora_torch``: tokens grouped by slot, blocks of up to 4 tokens of one adapter read each
adapter row once.

fp32 and bf16 (math in fp32). ``available()`` is False when the extension is not built or
``TRILLM_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from trillm._native import cpu_kernels, native_available

from . import recording
from ._cpu_ops import DTYPES, num_threads


@functools.cache
def _ext() -> ModuleType | None:
    try:
        return cpu_kernels("lora")
    except AttributeError:  # a cpu_kernels built before ext/cpu_lora.cpp: the torch path
        return None


def available() -> bool:
    return native_available("cpu_kernels") and _ext() is not None


def _require() -> ModuleType:
    ext = _ext()
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_kernels is not built.")
    return ext


def supports(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> bool:
    """CPU tensors of one dtype (fp32 or bf16); x and y 2-D, contiguous in their last dim; the
    stacks contiguous."""
    return (
        x.is_cpu
        and x.dtype in DTYPES
        and x.dtype == y.dtype == a.dtype == bt.dtype
        and x.dim() == 2
        and y.dim() == 2
        and x.stride(1) == 1
        and y.stride(1) == 1
        and a.is_contiguous()
        and bt.is_contiguous()
    )


def _check(
    x: torch.Tensor, y: torch.Tensor | None, stack: torch.Tensor, slots: torch.Tensor
) -> None:
    if slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous():
        raise ValueError("slots must be a contiguous 1-D int64 tensor.")
    if slots.shape[0] != x.shape[0]:
        raise ValueError(f"{slots.shape[0]} slots for {x.shape[0]} tokens.")
    if stack.dim() != 3:
        raise ValueError(f"an adapter stack is [L, R, features], got {tuple(stack.shape)}.")
    if not supports(x, x if y is None else y, stack, stack):
        raise ValueError("lora_cpu needs CPU fp32 or bf16 tensors of one dtype, rows contiguous.")


def shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [L, R, in]
    slots: torch.Tensor,  # [T] int64, -1 = no adapter
    scales: torch.Tensor,  # [L] fp32
) -> torch.Tensor:  # [T, R] fp32
    _check(x, None, a, slots)
    if a.shape[2] != x.shape[1] or scales.shape != (a.shape[0],):
        raise ValueError(
            f"a {tuple(a.shape)} / scales {tuple(scales.shape)} do not fit x {tuple(x.shape)}."
        )
    scales = scales.to(torch.float32).contiguous()
    buf = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32)
    recording.call(
        _require().shrink,
        buf=buf.data_ptr(),
        x=x.data_ptr(),
        ldx=x.stride(0),
        a=a.data_ptr(),
        slots=slots.data_ptr(),
        scales=scales.data_ptr(),
        num_tokens=x.shape[0],
        in_features=x.shape[1],
        rank=a.shape[1],
        num_slots=a.shape[0],
        dtype=DTYPES[x.dtype],
        num_threads=num_threads(),
    )
    return buf


def expand_(
    y: torch.Tensor,  # [T, out], updated in place
    buf: torch.Tensor,  # [T, R] fp32
    bt: torch.Tensor,  # [L, R, out]
    slots: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    _check(y, y, bt, slots)
    if bt.shape[2] != y.shape[1] or tuple(buf.shape) != (y.shape[0], bt.shape[1]):
        raise ValueError(
            f"bt {tuple(bt.shape)} / buf {tuple(buf.shape)} do not fit y {tuple(y.shape)}."
        )
    if buf.dtype != torch.float32 or not buf.is_contiguous():
        raise ValueError("buf must be a contiguous fp32 tensor (shrink's result).")
    recording.call(
        _require().expand,
        y=y.data_ptr(),
        ldy=y.stride(0),
        buf=buf.data_ptr(),
        bt=bt.data_ptr(),
        slots=slots.data_ptr(),
        num_tokens=y.shape[0],
        out_features=y.shape[1],
        rank=bt.shape[1],
        num_slots=bt.shape[0],
        dtype=DTYPES[y.dtype],
        num_threads=num_threads(),
    )
    return y


def add_lora_(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [L, R, in]
    bt: torch.Tensor,  # [L, R, out]
    slots: torch.Tensor,  # [T] int64
    scales: torch.Tensor,  # [L] fp32
) -> torch.Tensor:
    return expand_(y, shrink(x, a, slots, scales), bt, slots)
