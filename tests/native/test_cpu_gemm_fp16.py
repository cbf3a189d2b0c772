"""The fp16 CPU GEMM (``ext/cpu_gemm_fp16.cpp`` via ``kernels/linear_fp16_cpu.py``) against a
torch reference (the fp16 values multiplied in fp64, rounded to fp16 once), its independence of
the row count and thread count, and the fp16 model layers routed through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trillm.kernels import linear_fp16_cpu
from trillm.model_executor.layers import linear as linear_layers

needs_kernel = pytest.mark.skipif(
    not linear_fp16_cpu.available(),
    reason="trillm._ext.cpu_kernels is not built or this CPU lacks AVX2/FMA/F16C",
)
fp16 = torch.float16


def _reference(x, w, b=None):
    """The exact products of the fp16 values, summed in fp64: what the kernel's fp32 sums
    approximate before their one rounding to fp16."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _close(got, want):
    """``got`` (fp16) is ``want`` rounded, up to one fp16 step where the fp32 sums land on the
    other side of a rounding boundary (rare: checked by the share of exact ones)."""
    assert got.dtype == fp16
    torch.testing.assert_close(got.double(), want, rtol=2**-10, atol=2**-14)
    if want.numel() >= 1000:
        assert (got == want.to(fp16)).double().mean().item() > 0.99


def _data(m, n, k, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(fp16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(fp16)
    b = torch.randn(n, generator=g).to(fp16) if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("m", [0, 1, 5, 6, 7, 13, 193, 300])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 3), (16, 64), (65, 33), (130, 512), (48, 1409)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_reference(m, n, k, bias):
    x, w, b = _data(m, n, k, m * 1000 + n + k, bias)
    packed = linear_fp16_cpu.PackedWeightFp16(w)
    got = linear_fp16_cpu.linear_fp16(x, packed, None if b is None else b.float())
    assert got.shape == (m, n)
    if m:
        _close(got, _reference(x, w, b))


@needs_kernel
def test_strided_rows_and_leading_dims():
    x, w, _ = _data(24, 40, 72, 7)
    wide = torch.zeros(24, 100, dtype=fp16)
    wide[:, 10:82] = x
    packed = linear_fp16_cpu.PackedWeightFp16(w)
    got = linear_fp16_cpu.linear_fp16(wide[:, 10:82], packed)
    assert torch.equal(got, linear_fp16_cpu.linear_fp16(x.contiguous(), packed))
    batched = linear_fp16_cpu.linear_fp16(x.view(2, 12, 72), packed)
    assert batched.shape == (2, 12, 40) and torch.equal(batched.view(24, 40), got)


@needs_kernel
def test_a_row_gets_the_same_bits_at_any_row_count_and_thread_count():
    """Each output is one fixed chain of FMAs over k: batching requests (1 to 300 rows, row
    blocks of 192, register blocks of 6, panels widened past 12 rows) or threads never change
    a row's value."""
    x, w, b = _data(300, 200, 576, 11, bias=True)
    packed = linear_fp16_cpu.PackedWeightFp16(w)
    bias = b.float()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat(
            [linear_fp16_cpu.linear_fp16(x[i : i + 1], packed, bias) for i in range(300)]
        )
        torch.set_num_threads(2)
        together = linear_fp16_cpu.linear_fp16(x, packed, bias)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(alone, together)


@needs_kernel
def test_refuses_other_dtypes():
    x, w, _ = _data(2, 16, 8, 3)
    with pytest.raises(ValueError, match="needs a 2-D fp16 CPU weight"):
        linear_fp16_cpu.PackedWeightFp16(w.float())
    packed = linear_fp16_cpu.PackedWeightFp16(w)
    with pytest.raises(ValueError, match="x must be fp16 on CPU with last dim 8"):
        linear_fp16_cpu.linear_fp16(x.float(), packed)
    with pytest.raises(ValueError, match=r"bias must be fp32 \[16\]"):
        linear_fp16_cpu.linear_fp16(x, packed, torch.zeros(16, dtype=fp16))


@needs_kernel
def test_fp16_model_layers_are_packed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32, bias=False)).to(fp16).eval()
    x = torch.randn(9, 64).to(fp16)
    with torch.no_grad():
        want = model[1](F.linear(x, model[0].weight, model[0].bias))
        assert linear_layers.pack_cpu_linears(model) == 2
        got = model(x)
    assert all(hasattr(m, "packed_weight") for m in model)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
