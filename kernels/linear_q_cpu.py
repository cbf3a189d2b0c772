"""Linear layers with GGUF's Q4_0 / Q4_1 / Q8_0 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K weights, or
AWQ / GPTQ 4-bit groups, kept quantized on CPU.

A weight arrives as GGML blocks (32 values along K a block; per block an fp16 scale ``d``,
Q4_1 an fp16 minimum ``m`` too; values ``(q - 8) * d`` for Q4_0, ``q * d + m`` for Q4_1,
``q * d`` for Q8_0 with q signed; Q4_K: super-blocks of 256 values, ``(d * sc) * q - dmin * mn``
with fp16 d / dmin per super-block and 6-bit sc / mn per block of 32, each block becoming one
record with d / dmin repeated; Q6_K: super-blocks of 256, ``(d * sc) * (q - 32)`` with an int8
sc per 16 values, each block of 32 one record of Q8_0's bytes (q - 32) with d repeated and two
scales (9 bits a weight), or where the CPU has AVX512-BF16 and VBMI ``Q6_KP`` (trillm's: the
file's 6.5625 bits a weight, 4-bit and 2-bit fields, d once per super-block; ``kernel_type``,
``ext/cpu_gemm_q_q6.h``); Q2_K: ``(d * sc) * q - dmin * mn`` with q 0..3 and a 4-bit sc and mn per 16 values, and
Q3_K: ``(d * sc) * q`` with q -4..3 and a 6-bit sc - 32 per 16 values (stored as q + 4, dmin =
d, mn = 4 sc: the same values), repacked into ``Q4_KM`` (trillm's: Q4 nibbles, d / dmin
repeated, an int8 scale and minimum per half block of 16); Q5_K: Q4_K's values with a fifth bit
(q 0..31), repacked into ``Q5_KM`` (Q4_KM with the fifth bits as a 64-bit mask per quad of k,
Q5_K's per-32 scale and minimum repeated), or as AWQ / GPTQ groups (``from_groups``: 4-bit q, an fp16
scale and a 4-bit zero point per group of ``g`` values along K, values ``(q - z) * s``), which
become Q4_G: each group cut into blocks of 32 that repeat its scale and zero point (exact).
A stacked layer whose shards come in different types (a GGUF ``Q4_K_M`` qkv: q/k Q4_K, v Q6_K)
is a ``StackedQuantizedWeight`` of one ``QuantizedWeight`` per type: ``linear`` makes one kernel
call per part, each writing its columns of the one output (row stride N).
``QuantizedWeight`` repacks the blocks once, at load, into ``ext/cpu_gemm_q.cpp``'s panel
layout (the comment there; written and read back by ``q_panels``) of its ``kernel_type`` (its
``qtype``, the file's, but for Q3_K / Q5_K / Q2_K); ``linear`` multiplies by it:
x fp32 or bf16, output fp32 or bf16, fp32 sums, the numerics of dequantize-then-matmul.

``int8_activations=True`` rounds x per row, per half block of 16, to int8 with an fp32 scale
(``quantize_activations``) and multiplies by integer dot products (``vpdpbusd``, CPUs with
AVX512-VNNI): the numerics of ``F.linear(quantize_activations(x), dequantize(W))``.

The kernel is AVX-512's where the CPU has AVX512F/BW/VL, else an AVX2 / FMA / F16C one over the
same layout (``ext/cpu_gemm_q_avx2.h``: fp32 activations only); ``isa()`` says which, ``use_isa``
switches (tests, benchmarks). Without either (not built, ``TRILLM_NO_EXTENSIONS=1``, no AVX2 /
FMA / F16C; for int8 activations, no VNNI or the AVX2 kernel in use) ``linear`` dequantizes the
weight in torch on each call and uses ``F.linear`` (slow, but the weight stays quantized in
memory). ``dequantize`` is also the reference the kernel is tested against.
"""

from __future__ import annotations

import contextlib
import functools
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from trillm._native import native_available

from . import _cpu_ops, q_panels, recording
from .ggml_blocks import (  # the block formats (callers also name them here)
    BLOCK,
    GGML_BLOCK_BYTES,
    KERNEL_TYPES,
    KQUANT_BYTES,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_G,
    Q4_K,
    Q4_KM,
    Q5_K,
    Q5_KM,
    Q6_K,
    Q6_KP,
    Q8_0,
    QK_K,
    QTYPE_NAMES,
    unpack_ggml,
)

__all__ = [
    "ACT_BLOCK",
    "AnyQuantizedWeight",
    "BLOCK",
    "GGML_BLOCK_BYTES",
    "INT8_MIN_ROWS",
    "KERNEL_TYPES",
    "KQUANT_BYTES",
    "Q2_K",
    "Q3_K",
    "Q4_0",
    "Q4_1",
    "Q4_G",
    "Q4_K",
    "Q4_KM",
    "Q5_K",
    "Q5_KM",
    "Q6_K",
    "Q6_KP",
    "Q8_0",
    "QK_K",
    "QTYPE_NAMES",
    "QuantizedWeight",
    "StackedQuantizedWeight",
    "available",
    "dequantize",
    "int8_available",
    "isa",
    "kernel_type",
    "linear",
    "quantize_activations",
    "unpack_ggml",
    "use_int8",
    "use_isa",
]


@functools.cache
def _ext() -> ModuleType | None:
    return _cpu_ops.supported_module("gemm_q")


def available() -> bool:
    """Whether ``linear`` runs the native kernel (else it dequantizes in torch per call)."""
    return native_available("cpu_kernels") and _ext() is not None


def int8_available() -> bool:
    """Whether ``linear(..., int8_activations=True)`` runs natively (AVX512-VNNI, the AVX-512
    kernel in use)."""
    ext = _ext() if native_available("cpu_kernels") else None
    return ext is not None and bool(ext.supports_int8_activations())


def _require() -> ModuleType:
    ext = _ext()
    if ext is None:
        raise RuntimeError("quantized GEMM: trillm._ext.cpu_kernels not built or no AVX2/FMA/F16C.")
    return ext


def kernel_type(qtype: int) -> int:
    """The packed form a weight of GGML type ``qtype`` takes: ``KERNEL_TYPES``' (else itself),
    and Q6_K as Q6_KP (its file's 6.5625 bits a weight, not 9) where the kernel runs it (a CPU
    with AVX512-BF16 and AVX512-VBMI)."""
    kind = KERNEL_TYPES.get(qtype, qtype)
    if kind == Q6_K and available() and _require().supports_q6_kp():
        return Q6_KP
    return kind


def isa() -> str:
    """The kernel in use: ``"avx512"`` (the default where the CPU has AVX512F/BW/VL) or
    ``"avx2"``; RuntimeError without either."""
    return str(_require().get_isa())


def use_isa(name: str) -> contextlib.AbstractContextManager[None]:
    """Run the kernel ``name`` (``"avx2"`` or ``"avx512"``) inside the block, process-wide;
    ValueError for another name, RuntimeError where the CPU lacks it."""
    return _cpu_ops.use_isa(_require, name)


# benchmarks/kernels/q4_int8.py (benchmarks/archive/RESULTS-journal.md), SmolLM2's Q4_1 GEMMs: int8 1.2-1.3x faster at 16 rows,
# 1.45x at 64; at 1-4 rows (memory-bound) within this busy machine's noise, so those keep fp32
# activations and a small batch keeps the dequantized model's exact numerics.
INT8_MIN_ROWS = 16


def use_int8(weight: AnyQuantizedWeight, rows: int) -> bool:
    """Whether a model's layer multiplies ``rows`` rows by ``weight`` with int8 activations:
    the native VNNI kernel and at least ``INT8_MIN_ROWS`` rows."""
    return rows >= INT8_MIN_ROWS and int8_available()


ACT_BLOCK = 16  # activation values per int8 scale: half a weight block (ext/cpu_gemm_q_vnni.h)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:  # [M, K] fp32 -> [M, K] fp32
    """x rounded as the int8 path rounds it: per row, per half block of 16, dx = absmax / 127
    and x^ = round(x / dx) * dx (half to even; a half block of zeros stays zero)."""
    m, k = x.shape
    blocks = x.to(torch.float32).reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    dx = blocks.abs().amax(dim=2, keepdim=True) / 127.0  # [M, K/32, 1]
    safe = torch.where(dx > 0, dx, torch.ones_like(dx))
    q = torch.where(dx > 0, torch.round(blocks / safe), torch.zeros_like(blocks)).clamp(-127, 127)
    return (q * dx).reshape(m, k)


class QuantizedWeight:
    """A [N, K] Q4_0 / Q4_1 / Q8_0 / Q2_K .. Q6_K weight from GGML rows (or Q4_G:
    ``from_groups``), repacked for the kernel: ``qtype`` the file's type, ``kernel_type`` the
    packed form's."""

    def __init__(self, raw: np.ndarray, qtype: int, out_features: int, in_features: int) -> None:
        q, params = unpack_ggml(raw, qtype, in_features)
        if q.shape[0] != out_features:
            raise ValueError(f"{q.shape[0]} rows of blocks for a weight of {out_features} rows")
        self._set(q, params, qtype)

    def _set(self, q: np.ndarray, params: list[np.ndarray], qtype: int) -> None:
        self.qtype = qtype
        self.kernel_type = kernel_type(qtype)
        self.out_features, self.in_features = q.shape
        # [panels * nb * record] uint8
        self.data = torch.from_numpy(q_panels.pack(q, params, self.kernel_type))

    @classmethod
    def from_groups(cls, q: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> QuantizedWeight:
        """AWQ / GPTQ groups: q [N, K] 0..15, scales [N, G] fp16, zeros [N, G] 0..15, with
        ``K / G`` (the group size) a multiple of 32 -> a Q4_G weight of values (q - z) * s."""
        n, k = q.shape
        groups = scales.shape[1]
        if k % groups or (k // groups) % BLOCK or scales.shape != (n, groups):
            raise ValueError(f"4-bit groups: K={k} in {groups} groups of a multiple of {BLOCK}")
        if zeros.shape != scales.shape or scales.dtype != np.float16:
            raise ValueError("4-bit groups: scales must be fp16 [N, G], zeros [N, G]")
        if q.max(initial=0) > 15 or zeros.max(initial=0) > 15:
            raise ValueError("4-bit groups: values and zero points must be 0..15")
        repeat = k // groups // BLOCK  # blocks of 32 per group
        weight = cls.__new__(cls)
        weight._set(
            q.astype(np.uint8),
            [np.repeat(scales, repeat, axis=1), np.repeat(zeros.astype(np.uint8), repeat, axis=1)],
            Q4_G,
        )
        return weight

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class StackedQuantizedWeight:
    """A [N, K] weight whose row blocks come in different types: a GGUF layer that stacks
    projections (q/k/v, gate/up) stored in different GGML types, as llama.cpp's mixed formats
    (``Q4_K_M``: v and down in Q6_K, the rest Q4_K) store them. Each part keeps its own type;
    ``linear`` runs one kernel call per part, each writing its columns of the one output."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("stacked quantized weight: parts must share in_features")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.offsets = [0]  # first output column of each part, then N
        for part in parts:
            self.offsets.append(self.offsets[-1] + part.out_features)
        self.out_features = self.offsets[-1]

    @property
    def qtypes(self) -> tuple[int, ...]:
        return tuple(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


AnyQuantizedWeight = QuantizedWeight | StackedQuantizedWeight


def dequantize(weight: AnyQuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] values of ``weight`` (from the packed copy), in ``dtype``: the reference."""
    if isinstance(weight, StackedQuantizedWeight):
        return torch.cat([dequantize(p, dtype) for p in weight.parts], dim=0)
    return q_panels.unpack(
        weight.data, weight.kernel_type, weight.out_features, weight.in_features, dtype
    )


_IO = (torch.float32, torch.bfloat16)


def linear(
    x: torch.Tensor,  # [..., K] fp32 or bf16 CPU
    weight: AnyQuantizedWeight,
    bias: torch.Tensor | None = None,  # [N] fp32, added to the fp32 sums
    out_dtype: torch.dtype | None = None,  # fp32 or bf16; None: x's dtype
    int8_activations: bool = False,  # x rounded to int8 per block (module doc)
) -> torch.Tensor:  # [..., N]
    """``x @ W^T + bias`` with W kept quantized."""
    n, k = weight.out_features, weight.in_features
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.device.type != "cpu" or x.dtype not in _IO or x.shape[-1] != k:
        raise ValueError(f"linear_q_cpu.linear: x must be fp32 or bf16 on CPU, last dim {k}.")
    if out_dtype not in _IO:
        raise ValueError("linear_q_cpu.linear: out_dtype must be float32 or bfloat16.")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32):
        raise ValueError(f"linear_q_cpu.linear: bias must be fp32 [{n}].")
    if bias is not None:
        bias = bias.contiguous()
    ext = _ext() if native_available("cpu_kernels") else None
    if ext is None or (int8_activations and not int8_available()):
        # portable: dequantize, then torch's GEMM in fp32
        xf = x.reshape(-1, k).to(torch.float32)
        if int8_activations:
            xf = quantize_activations(xf)
        out = F.linear(xf, dequantize(weight), bias)
        return out.to(out_dtype).view(*x.shape[:-1], n)
    rows = x.reshape(-1, k)  # a view when the leading dims allow it, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=out_dtype)
    parts = weight.parts if isinstance(weight, StackedQuantizedWeight) else [weight]
    column = 0
    for part in parts:  # each part fills its columns of out (row stride n)
        recording.call(
            ext.linear,
            rows.data_ptr(),
            rows.dtype == torch.bfloat16,
            rows.shape[0],
            k,
            rows.stride(0),
            part.data.data_ptr(),
            part.kernel_type,
            part.out_features,
            0 if bias is None else bias.data_ptr() + 4 * column,
            out.data_ptr() + out.element_size() * column,
            out_dtype == torch.bfloat16,
            n,
            torch.get_num_threads(),
            int8_activations,
        )
        column += part.out_features
    return out.view(*x.shape[:-1], n)
