"""Linear layers on CPU through trillm's native GEMMs, weights packed once.

fp32 (``ext/cpu_gemm.cpp``): panels of 16 output columns, [K][16] each, instead of torch's sgemm
packing the weight again on each call -- most of the cost at decode-step row counts. Same
contract as ``torch.nn.functional.linear`` for fp32 CPU tensors; the torch reference is that
function itself. Two kernels over one packing, bit-identical results: AVX-512 where the CPU has
it, else AVX2 (``isa()`` says which; ``use_isa`` switches, for benchmarks and tests).
``available()`` is False when the extension is not built, ``TRILLM_NO_EXTENSIONS=1``, or the
CPU lacks AVX2/FMA; callers then keep ``F.linear``.

bf16 (``ext/cpu_gemm_bf16.cpp``, ``PackedWeightBf16`` / ``linear_bf16``): bf16 weights in panels
of 64 columns of k-pairs, multiplied by AVX512-BF16's ``vdpbf16ps`` with fp32 sums; x fp32 or
bf16, the output fp32 or bf16 (rounded once from the fp32 sums, as torch's bf16 matmul does).
The reference is ``F.linear`` on the bf16 values in fp32. ``available_bf16()`` is False without
the extension or on a CPU without AVX512-BF16 (a run-time check): callers keep ``F.linear``.
"""

from __future__ import annotations

import contextlib
import functools
from types import ModuleType

import torch

from trillm._native import native_available

from . import _cpu_ops, recording


@functools.cache
def _ext() -> ModuleType | None:
    """``trillm._ext.cpu_kernels.gemm`` when built and this CPU has AVX2/FMA, else None; looked
    up once (``linear`` runs for every layer of every step)."""
    return _cpu_ops.supported_module("gemm")


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
            weight.data_ptr(),
            self.out_features,
            self.in_features,
            weight.stride(0),
            self.data.data_ptr(),
        )

    def unpack(self) -> torch.Tensor:  # [N, K] fp32, a new tensor
        """The weight back from its panels, exactly (for torch's GEMM off the kernel's path)."""
        panel = _require().PANEL
        panels = self.data.view(-1, self.in_features, panel)  # [P, K, 16]
        return panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].clone()


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
    recording.call(
        ext.linear,
        rows.data_ptr(),
        rows.shape[0],
        k,
        rows.stride(0),
        weight.data.data_ptr(),
        n,
        bias_ptr,
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)


def isa() -> str:
    """The fp32 kernel in use: ``"avx512"`` (the default where the CPU has AVX-512F) or
    ``"avx2"``."""
    return str(_require().get_isa())


def use_isa(name: str) -> contextlib.AbstractContextManager[None]:
    """Run the fp32 kernel ``name`` (``"avx2"`` or ``"avx512"``) inside the block, process-wide;
    ValueError for another name, RuntimeError where the CPU lacks it."""
    return _cpu_ops.use_isa(_require, name)


@functools.cache
def _ext_bf16() -> ModuleType | None:
    """``trillm._ext.cpu_kernels.gemm_bf16`` when built and this CPU has AVX512-BF16, else
    None (looked up once)."""
    return _cpu_ops.supported_module("gemm_bf16")


def available_bf16() -> bool:
    return native_available("cpu_kernels") and _ext_bf16() is not None


def _require_bf16() -> ModuleType:
    ext = _ext_bf16()
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_kernels is not built or this CPU lacks AVX512-BF16.")
    return ext


# On a CPU with AMX-BF16 torch's bf16 F.linear runs oneDNN's AMX GEMM, several times this
# kernel's rate once the rows fill its 16-row tiles; below that the kernel wins (no per-call
# weight reordering, half the weight bytes of fp32). SmolLM2-135M's 121 weights a pass, 2
# threads, alternated (2026-12-01 20:06 UTC): kernel / torch 1.80x at 1 row, 1.45x at 4, 1.29x
# at 8, 0.94x at 16, 0.25x at 256. benchmarks/archive/RESULTS-journal.md, section 6.
AMX_KERNEL_MAX_ROWS = 8


@functools.cache
def bf16_kernel_max_rows() -> int | None:
    """Most rows a bf16 call should give the kernel: None (any) without AMX-BF16."""
    ext = _ext_bf16()
    return AMX_KERNEL_MAX_ROWS if ext is not None and ext.amx_bf16() else None


def supports_bf16(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [N, K] can be packed for ``linear_bf16``: bf16 on CPU, 2-D, no
    autograd."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not weight.requires_grad
    )


class PackedWeightBf16:
    """A [N, K] bf16 weight packed for ``linear_bf16`` (a copy, like ``PackedWeight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        ext = _require_bf16()
        if not supports_bf16(weight) or weight.stride(1) != 1:
            raise ValueError(
                "PackedWeightBf16 needs a 2-D bf16 CPU weight, contiguous in its last dim."
            )
        self.out_features, self.in_features = weight.shape
        self.panel: int = ext.PANEL  # output columns a panel
        size = ext.packed_size(self.out_features, self.in_features)
        self.data = torch.empty(size, dtype=torch.bfloat16)
        ext.pack(
            weight.data_ptr(),
            self.out_features,
            self.in_features,
            weight.stride(0),
            self.data.data_ptr(),
        )

    def unpack(self) -> torch.Tensor:  # [N, K] bf16, a new tensor
        """The weight back from its panels of k-pairs, exactly (``pack``'s layout: panel p is
        [ceil(K / 2)][64][2], the padding dropped)."""
        pairs = (self.in_features + 1) // 2
        panels = self.data.view(-1, pairs, self.panel, 2).permute(0, 2, 1, 3)  # [P, 64, K/2, 2]
        rows = panels.reshape(-1, 2 * pairs)  # [P * 64, K rounded up to even]
        return rows[: self.out_features, : self.in_features].clone()


_BF16_IO = (torch.float32, torch.bfloat16)


def linear_bf16(
    x: torch.Tensor,  # [..., K] fp32 or bf16 CPU (fp32 is rounded to bf16 first)
    weight: PackedWeightBf16,
    bias: torch.Tensor | None = None,  # [N] fp32 or bf16, added to the fp32 sums
    out_dtype: torch.dtype | None = None,  # fp32 or bf16; None: x's dtype
) -> torch.Tensor:  # [..., N]
    """``x @ W^T + bias`` with W bf16 packed, products summed in fp32."""
    ext = _require_bf16()
    n, k = weight.out_features, weight.in_features
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.device.type != "cpu" or x.dtype not in _BF16_IO or x.shape[-1] != k:
        raise ValueError(f"linear_cpu.linear_bf16: x must be fp32 or bf16 on CPU, last dim {k}.")
    if out_dtype not in _BF16_IO:
        raise ValueError("linear_cpu.linear_bf16: out_dtype must be float32 or bfloat16.")
    if bias is not None:
        if bias.shape != (n,) or bias.dtype not in _BF16_IO or bias.device.type != "cpu":
            raise ValueError(f"linear_cpu.linear_bf16: bias must be fp32 or bf16 [{n}] on CPU.")
        bias = bias.to(torch.float32).contiguous()
    rows = x.reshape(-1, k)  # a view when the leading dims allow it, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=out_dtype)
    recording.call(
        ext.linear,
        rows.data_ptr(),
        rows.dtype == torch.bfloat16,
        rows.shape[0],
        k,
        rows.stride(0),
        weight.data.data_ptr(),
        n,
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out_dtype == torch.bfloat16,
        n,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)
