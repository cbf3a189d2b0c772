"""Batched LoRA kernels (shrink / expand with a per-token adapter slot): the torch reference
and the native CPU kernel (its AVX-512 and generic builds, fp32 and bf16) against a per-token
loop written from the definition in float64. The Triton kernel is checked in
tests/native/test_kernels.py (interpreter); adapters on a model in tests/lora/test_lora.py."""

from __future__ import annotations

import pytest
import torch

import trillm.kernels.dispatch as dispatch
from trillm.kernels import lora_cpu, lora_torch


def _data(tokens, in_f, rank, out_f, num_slots, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_f, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, in_f, generator=gen) * 0.1).to(dtype)
    bt = (torch.randn(num_slots, rank, out_f, generator=gen) * 0.1).to(dtype)
    y = torch.randn(tokens, out_f, generator=gen).to(dtype)
    slots = torch.randint(-1, num_slots, (tokens,), generator=gen)
    slots[0] = -1  # always a base-model token
    slots[-1] = num_slots - 1  # and one with an adapter
    scales = torch.rand(num_slots, generator=gen) + 0.5
    return y, x, a, bt, slots, scales


def _definition(y, x, a, bt, slots, scales):
    """y[t] + scale[s] * (x[t] @ A[s]^T) @ B[s]^T token by token, float64; slot -1: y[t]."""
    out = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += scales[s].double() * (x[t].double() @ a[s].double().t()) @ bt[s].double()
    return out


IMPLS = [pytest.param(lora_torch, id="torch")]
if lora_cpu.available():
    IMPLS.append(pytest.param(lora_cpu, id="native"))
SHAPES = [  # tokens, in, rank, out, slots: tails of the 16-wide loads / 32-wide stores
    (2, 48, 8, 48, 1),
    (37, 96, 24, 130, 3),
    (300, 512, 48, 1536, 4),  # large enough for the native thread pool
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_the_definition(impl, shape):
    y, x, a, bt, slots, scales = _data(*shape, seed=sum(shape))
    want = _definition(y, x, a, bt, slots, scales)
    got = impl.add_lora_(y.clone(), x, a, bt, slots, scales)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    base = slots < 0
    assert torch.equal(got[base], y[base])  # base-model rows untouched, bit for bit
    assert not torch.allclose(got[~base], y[~base])  # the adapters did change the rest


@pytest.mark.parametrize("impl", IMPLS)
def test_shrink_zeroes_base_rows_and_scales_per_slot(impl):
    _, x, a, _, slots, scales = _data(9, 40, 16, 24, 2, seed=3)
    buf = impl.shrink(x, a, slots, scales)
    assert buf.dtype == torch.float32 and buf.shape == (9, 16)
    assert torch.equal(buf[slots < 0], torch.zeros_like(buf[slots < 0]))
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(buf[t], scales[s] * (x[t] @ a[s].t()), rtol=1e-5, atol=1e-6)


needs_native = pytest.mark.skipif(not lora_cpu.available(), reason="native kernels not built")


@pytest.fixture(params=["avx512", "generic"])
def native_build(request):
    ext = lora_cpu._require()
    if request.param == "avx512" and not ext.avx512():
        pytest.skip("this CPU has no AVX-512")
    ext.set_use_avx512(request.param == "avx512")
    yield request.param
    ext.set_use_avx512(ext.avx512())


@needs_native
@pytest.mark.parametrize("shape", SHAPES)
def test_native_builds_match_the_reference(native_build, shape):
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
        y, x, a, bt, slots, scales = _data(*shape, seed=7 * sum(shape), dtype=dtype)
        want = lora_torch.add_lora_(y.clone(), x, a, bt, slots, scales)
        got = lora_cpu.add_lora_(y.clone(), x, a, bt, slots, scales)
        assert got.dtype == dtype
        # bf16: both sum in fp32 and round once; they differ by at most one bf16 step
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        assert torch.equal(got[slots < 0], y[slots < 0])


@needs_native
def test_native_refuses_a_slot_outside_the_stack():
    y, x, a, bt, slots, scales = _data(5, 16, 16, 16, 2, seed=1)
    slots[2] = 2
    with pytest.raises(ValueError, match="slot 2"):
        lora_cpu.add_lora_(y, x, a, bt, slots, scales)


@needs_native
def test_native_on_strided_rows():
    """x and y as column slices of wider buffers (a fused projection's output)."""
    y, x, a, bt, slots, scales = _data(11, 32, 16, 64, 3, seed=5)
    wide_x = torch.zeros(11, 80)
    wide_x[:, 8:40] = x
    wide_y = torch.zeros(11, 100)
    wide_y[:, 20:84] = y
    lora_cpu.add_lora_(wide_y[:, 20:84], wide_x[:, 8:40], a, bt, slots, scales)
    want = lora_torch.add_lora_(y.clone(), x, a, bt, slots, scales)
    torch.testing.assert_close(wide_y[:, 20:84], want, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(wide_y[:, :20]) == 0 and torch.count_nonzero(wide_y[:, 84:]) == 0


def test_dispatch_takes_the_native_kernel_on_cpu(monkeypatch):
    y, x, a, bt, slots, scales = _data(6, 32, 16, 32, 2, seed=2)
    want = lora_torch.add_lora_(y.clone(), x, a, bt, slots, scales)
    calls = []
    chosen = lora_cpu if lora_cpu.available() else lora_torch
    original = chosen.add_lora_
    monkeypatch.setattr(chosen, "add_lora_", lambda *args: calls.append(1) or original(*args))
    with torch.inference_mode():
        got = dispatch.add_lora_(y.clone(), x, a, bt, slots, scales)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
