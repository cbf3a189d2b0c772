"""kernels/linear_q_cpu.py: GGUF Q4_0 / Q4_1 / Q8_0 weights kept quantized (issue 13).

The repacked layout is checked against the gguf package's own dequantizer (an independent
reader of GGML blocks); the native kernel against dequantize-then-F.linear on random blocks,
edge shapes included; the portable path (no extension) against the same reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from trillm.kernels import linear_q_cpu

QTYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
needs_kernel = pytest.mark.skipif(
    not linear_q_cpu.available(), reason="trillm._ext.cpu_kernels not built or no AVX-512"
)


def _weight(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_1:
        w += rng.uniform(-1, 1, (n, 1)).astype(np.float32)  # blocks with a nonzero minimum
    raw = quants.quantize(w, qtype)  # [N, K/32 * block bytes] uint8, GGML's blocks
    return raw, torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 17, 33, 48])
def test_packed_layout_dequantizes_like_gguf(qtype, n):
    raw, expected = _weight(qtype, n, 96)
    weight = linear_q_cpu.QuantizedWeight(raw, int(qtype), n, 96)
    assert torch.equal(linear_q_cpu.dequantize(weight), expected)


def _check(qtype, m, n, k, x_dtype, out_dtype, bias):
    raw, w = _weight(qtype, n, k, seed=m * 1000 + n)
    weight = linear_q_cpu.QuantizedWeight(raw, int(qtype), n, k)
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    b = torch.randn(n, generator=gen) if bias else None
    got = linear_q_cpu.linear(x, weight, b, out_dtype=out_dtype)
    ref = F.linear(x.to(torch.float32), w, b)  # [m, n] fp32
    assert got.shape == (m, n) and got.dtype == out_dtype
    if out_dtype == torch.bfloat16:  # one rounding of the fp32 sums to bf16
        torch.testing.assert_close(got, ref.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got, ref, atol=2e-4 * k**0.5, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 64])
@pytest.mark.parametrize("n", [1, 15, 33, 70])
def test_kernel_matches_dequantize_then_matmul(qtype, m, n):
    _check(qtype, m, n, 64, torch.float32, torch.float32, bias=n % 2 == 1)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("x_dtype", "out_dtype"), [
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
])  # fmt: skip
def test_kernel_bf16_activations_and_outputs(qtype, x_dtype, out_dtype):
    _check(qtype, 9, 37, 128, x_dtype, out_dtype, bias=True)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_kernel_large_threaded_call_and_strided_rows(qtype):
    # Over the 1-MFLOP threshold: several threads, row blocks of 64 and a remainder tile.
    _check(qtype, 131, 96, 576, torch.float32, torch.float32, bias=False)
    raw, w = _weight(qtype, 40, 64)
    weight = linear_q_cpu.QuantizedWeight(raw, int(qtype), 40, 64)
    x = torch.randn(6, 128)[:, ::2]  # rows with a stride, last dim not contiguous
    torch.testing.assert_close(linear_q_cpu.linear(x, weight), F.linear(x, w), atol=2e-3,
                               rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_portable_path_without_extensions(qtype, monkeypatch):
    monkeypatch.setenv("TRILLM_NO_EXTENSIONS", "1")
    assert not linear_q_cpu.available()
    _check(qtype, 3, 20, 64, torch.float32, torch.float32, bias=True)
    _check(qtype, 3, 20, 64, torch.bfloat16, torch.bfloat16, bias=False)


def test_bad_inputs_are_refused():
    raw, _ = _weight(GGMLQuantizationType.Q8_0, 4, 64)
    weight = linear_q_cpu.QuantizedWeight(raw, int(GGMLQuantizationType.Q8_0), 4, 64)
    with pytest.raises(ValueError, match="last dim 64"):
        linear_q_cpu.linear(torch.zeros(2, 32), weight)
    with pytest.raises(ValueError, match="multiple of 32"):
        linear_q_cpu.unpack_ggml(raw, int(GGMLQuantizationType.Q8_0), 48)
    with pytest.raises(ValueError, match="rows of blocks"):
        linear_q_cpu.QuantizedWeight(raw, int(GGMLQuantizationType.Q8_0), 5, 64)
