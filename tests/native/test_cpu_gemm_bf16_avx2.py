"""The bf16 form of the AVX2 16-bit GEMM (``ext/cpu_gemm_fp16.cpp``'s kernel over bf16, via
``kernels/linear_bf16_avx2_cpu.py``): against the exact sums (fp64) and torch's bf16
``F.linear``, its row/thread independence, the run-time choice between it and the AVX512-BF16
kernel, and a tiny bf16 Llama's greedy tokens through it against transformers'.

Tolerances. The kernel's output is its fp32 sum rounded to bf16 once (nearest even). The fp32
sum of K exact products differs from the exact one by at most e = K * 2^-24 * sum|x_i w_i|
(standard recursive-summation bound), and rounding adds at most half a bf16 step, 2^-8 of the
value: |got - exact| <= 2^-8 * |exact| + e * (1 + 2^-8). torch's bf16 ``F.linear`` obeys the
same bound (fp32 sums rounded once, in its own order), so the two are within one bf16 step
(2^-7 relative) plus 2e of each other, and equal where no rounding boundary lies between their
fp32 sums (checked as a share of exact agreements).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trillm.kernels import linear_bf16_avx2_cpu, linear_cpu
from trillm.model_executor.layers import linear as linear_layers

needs_kernel = pytest.mark.skipif(
    not linear_bf16_avx2_cpu.available(),
    reason="trillm._ext.cpu_kernels is not built or this CPU lacks AVX2/FMA/F16C",
)
bf16 = torch.bfloat16


def _data(m, n, k, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(bf16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(bf16)
    b = torch.randn(n, generator=g).to(bf16) if bias else None
    return x, w, b


def _exact(x, w, b=None):
    """The bf16 values' products summed in fp64 (exact here), and the fp32 summation bound e."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    mass = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    return want, (x.shape[-1] + 1) * 2.0**-24 * mass


def _check(got, x, w, b=None):
    assert got.dtype == bf16
    want, e = _exact(x, w, b)
    err = (got.double() - want).abs()
    assert bool((err <= 2.0**-8 * want.abs() + e * (1 + 2.0**-8)).all()), float(err.max())
    if want.numel() >= 1000:  # a boundary between the fp32 and exact sums is rare
        assert (got == want.to(bf16)).double().mean().item() > 0.99


def _pack(w):
    return linear_bf16_avx2_cpu.PackedWeightBf16Avx2(w)


@needs_kernel
@pytest.mark.parametrize("m", [0, 1, 5, 6, 7, 13, 64, 193, 256])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 3), (16, 64), (65, 33), (130, 512), (48, 1409)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_exact_sums(m, n, k, bias):
    x, w, b = _data(m, n, k, m * 1000 + n + k, bias)
    got = linear_bf16_avx2_cpu.linear_bf16(x, _pack(w), None if b is None else b.float())
    assert got.shape == (m, n)
    if m:
        _check(got, x, w, b)


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 130, 512), (17, 65, 33), (256, 200, 576)])
def test_matches_torch_bf16_linear(m, n, k):
    x, w, b = _data(m, n, k, 5 + m, bias=True)
    got = linear_bf16_avx2_cpu.linear_bf16(x, _pack(w), b.float())
    torch_out = F.linear(x, w, b)
    _, e = _exact(x, w, b)
    diff = (got.double() - torch_out.double()).abs()
    scale = torch.maximum(got.double().abs(), torch_out.double().abs())
    assert bool((diff <= 2.0**-7 * scale + 2 * e * (1 + 2.0**-8)).all()), float(diff.max())
    if got.numel() >= 1000:
        assert (got == torch_out).double().mean().item() > 0.98


@needs_kernel
def test_rounding_is_to_nearest_even_and_nan_stays_nan():
    # One column, K = 1: the output is x * w exactly in fp32, then rounded: a tie (halfway
    # between two bf16 values) goes to the even one, as torch's fp32 -> bf16 conversion does.
    w = torch.ones(1, 1, dtype=bf16)
    x = torch.tensor([[1.0], [2.0], [float("inf")], [float("nan")]], dtype=bf16)
    bias = torch.tensor([2.0**-8 * 3])  # 1 + 3 * 2^-8: halfway between 1 + 2^-7 and 1 + 2^-6
    got = linear_bf16_avx2_cpu.linear_bf16(x, _pack(w), bias).float().flatten()
    want = (x.float().flatten() + bias).to(bf16).float()
    assert torch.equal(got[:3], want[:3]) and got[0].item() == 1 + 2.0**-6
    assert got[3].isnan()


@needs_kernel
def test_strided_rows_and_leading_dims():
    x, w, _ = _data(24, 40, 72, 7)
    wide = torch.zeros(24, 100, dtype=bf16)
    wide[:, 10:82] = x
    packed = _pack(w)
    got = linear_bf16_avx2_cpu.linear_bf16(wide[:, 10:82], packed)
    assert torch.equal(got, linear_bf16_avx2_cpu.linear_bf16(x.contiguous(), packed))
    batched = linear_bf16_avx2_cpu.linear_bf16(x.view(2, 12, 72), packed)
    assert batched.shape == (2, 12, 40) and torch.equal(batched.view(24, 40), got)
    _check(got, x, w)


@needs_kernel
def test_a_row_gets_the_same_bits_at_any_row_count_and_thread_count():
    x, w, b = _data(300, 200, 576, 11, bias=True)
    packed, bias = _pack(w), b.float()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat(
            [linear_bf16_avx2_cpu.linear_bf16(x[i : i + 1], packed, bias) for i in range(300)]
        )
        torch.set_num_threads(2)
        together = linear_bf16_avx2_cpu.linear_bf16(x, packed, bias)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(alone, together)


@needs_kernel
def test_refuses_other_dtypes():
    x, w, _ = _data(2, 16, 8, 3)
    with pytest.raises(ValueError, match="needs a 2-D bf16 CPU weight"):
        _pack(w.half())
    packed = _pack(w)
    with pytest.raises(ValueError, match="x must be bf16 on CPU with last dim 8"):
        linear_bf16_avx2_cpu.linear_bf16(x.float(), packed)
    with pytest.raises(ValueError, match=r"bias must be fp32 \[16\]"):
        linear_bf16_avx2_cpu.linear_bf16(x, packed, torch.zeros(16, dtype=bf16))


# ------------------------------------------------------------------ run-time choice


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 96)
        self.down = nn.Linear(96, 32, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def test_avx512_bf16_kernel_is_chosen_where_present(monkeypatch):
    # AVX512-BF16 present (mocked: the CPU query): that kernel, not the AVX2 one, whatever
    # AVX2 says; absent: the AVX2 kernel where F16C is there, else torch's F.linear.
    monkeypatch.setattr(linear_cpu, "available_bf16", lambda: True)
    monkeypatch.setattr(linear_bf16_avx2_cpu, "available", lambda: True)
    assert linear_layers.bf16_kernel() == "avx512_bf16"
    monkeypatch.setattr(linear_cpu, "available_bf16", lambda: False)
    assert linear_layers.bf16_kernel() == "avx2"
    monkeypatch.setattr(linear_bf16_avx2_cpu, "available", lambda: False)
    assert linear_layers.bf16_kernel() is None
    model = _Block().to(bf16).eval()
    assert linear_layers.pack_cpu_linears(model) == 0 and "forward" not in vars(model.up)


def test_avx512_bf16_host_packs_for_that_kernel(monkeypatch):
    monkeypatch.setattr(linear_cpu, "available_bf16", lambda: True)
    made = []
    monkeypatch.setattr(linear_cpu, "PackedWeightBf16", lambda w: made.append(w.shape) or "p")
    model = _Block().to(bf16).eval()
    assert linear_layers.pack_cpu_linears(model) == 2
    assert made == [(96, 32), (32, 96)] and model.up.packed_weight == "p"
    assert model.up.forward.__func__ is linear_layers._packed_forward_bf16


@needs_kernel
def test_bf16_layers_go_through_the_avx2_kernel_without_avx512_bf16(monkeypatch):
    monkeypatch.setattr(linear_cpu, "available_bf16", lambda: False)
    torch.manual_seed(3)
    model = _Block().to(bf16).eval()
    x = torch.randn(5, 32).to(bf16)
    with torch.inference_mode():
        want = model(x)  # torch's bf16 F.linear
    assert linear_layers.pack_cpu_linears(model) == 2
    assert isinstance(model.up.packed_weight, linear_bf16_avx2_cpu.PackedWeightBf16Avx2)
    calls = []
    real = linear_bf16_avx2_cpu.linear_bf16
    monkeypatch.setattr(
        linear_bf16_avx2_cpu,
        "linear_bf16",
        lambda *a, **kw: calls.append(a[0].shape[-1]) or real(*a, **kw),
    )
    with torch.inference_mode():
        got = model(x)
    assert calls == [32, 96] and got.dtype == bf16
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
    wide = x.float().requires_grad_()
    out = model(wide.to(bf16))  # autograd on: torch's F.linear on the unpacked weights
    assert calls == [32, 96] and torch.equal(out.detach(), want)
    out.float().sum().backward()
    assert wide.grad is not None and model.up.weight.numel() == 0
