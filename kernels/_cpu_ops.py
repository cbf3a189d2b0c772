"""What the ``*_cpu`` wrappers of ``ext/cpu_ops.cpp`` share: the extension module, the dtype
codes, and the strided-rows description of a tensor that the native kernels take. Also what
the GEMM wrappers (``linear*_cpu.py``) share: their module's lookup (``supported_module``) and
the switch between a GEMM's AVX2 and AVX-512 kernels (``use_isa``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

from trillm._native import cpu_kernels, native_available

DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def extension() -> ModuleType | None:
    """``trillm._ext.cpu_kernels.ops``, or None when not built or ``TRILLM_NO_EXTENSIONS=1``.

    NOTE: looked up once per process (the dispatch asks on every op call, and reading the
    environment costs microseconds); ``extension.cache_clear()`` looks again."""
    return cpu_kernels("ops") if native_available("cpu_kernels") else None


def require() -> ModuleType:
    """The extension, for the wrappers' direct callers (the dispatch checks ``available()``)."""
    ext = extension()
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_kernels is not built (or TRILLM_NO_EXTENSIONS=1).")
    return ext


def supported_module(name: str) -> ModuleType | None:
    """``trillm._ext.cpu_kernels.<name>`` when built and this CPU runs its kernel (the
    module's ``supported()``), else None. NOTE: not cached here: each wrapper caches its own."""
    ext = cpu_kernels(name)
    return ext if ext is not None and ext.supported() else None


@contextlib.contextmanager
def use_isa(require: Callable[[], ModuleType], name: str) -> Iterator[None]:
    """Run the kernel ``name`` (``"avx2"`` or ``"avx512"``) of the module ``require()`` returns
    (it raises where there is none) inside the block, process-wide, then the one it ran
    before; ValueError for another name."""
    ext = require()
    before = str(ext.get_isa())
    if name not in ("avx2", "avx512"):
        raise ValueError(f"use_isa: {name!r} is not 'avx2' or 'avx512'.")
    ext.set_isa(name)
    try:
        yield
    finally:
        ext.set_isa(before)


def num_threads() -> int:
    """The native ops split large inputs over torch's intra-op thread count."""
    return torch.get_num_threads()


def rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """t [..., n] (1 to 3 dims, the last contiguous) as rows of a [outer, inner, n] layout:
    (data_ptr, outer stride, inner stride, inner count), strides in elements."""
    shape, strides = t.shape, t.stride()  # NOTE: once each; this runs on every op call
    if not 1 <= len(shape) <= 3:
        raise ValueError(f"Expected a tensor of 1 to 3 dims, got shape {tuple(shape)}.")
    if strides[-1] != 1 and shape[-1] > 1:
        raise ValueError(f"The last dim must be contiguous (strides {strides}).")
    if len(shape) == 3:
        return t.data_ptr(), strides[0], strides[1], shape[1]
    if len(shape) == 2:
        return t.data_ptr(), 0, strides[0], shape[0]
    return t.data_ptr(), 0, 0, 1
