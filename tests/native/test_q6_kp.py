"""Q6_KP: GGUF's Q6_K packed at the file's size (6.5625 bits a weight, not Q6_K's 9) where the
CPU has AVX512-BF16 and VBMI (ext/cpu_gemm_q_q6.h, kernels/q_panels.py).

The packing round-trips every value (pure numpy / torch, on any host) and reads back as the
gguf package dequantizes; bf16 rows (the batch-1 `vpermt2w` + `vdpbf16ps` kernel) equal
dequantize-then-matmul exactly on integer values over random blocks (every bit pattern of the
4-bit and 2-bit fields at every position) and within fp32 summation on random ones; the other
paths (fp32 rows, int8 activations, the AVX2 kernel: the panels expanded into Q6_K's records)
give the same results, bit for bit, as the same weight packed as Q6_K.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from trillm.kernels import linear_q_cpu, q_panels
from trillm.testing.gguf_models import random_kquant_blocks


def _blocks(n: int, k: int, seed: int, d: float = 5e-4, unit_scales: bool = False) -> np.ndarray:
    raw = random_kquant_blocks("Q6_K", n, k, seed)
    blocks = raw.reshape(n * k // 256, 210)
    blocks[:, 208:210] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if unit_scales:
        blocks[:, 192:208] = 1
    return raw


def _reference(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float32))


def _as_q6_k(weight: linear_q_cpu.QuantizedWeight, raw: np.ndarray) -> linear_q_cpu.QuantizedWeight:
    """The same weight packed in Q6_K's 9-bit form (what every CPU packed before Q6_KP)."""
    twin = linear_q_cpu.QuantizedWeight.__new__(linear_q_cpu.QuantizedWeight)
    q, params = linear_q_cpu.unpack_ggml(raw, linear_q_cpu.Q6_K, weight.in_features)
    twin.qtype = twin.kernel_type = linear_q_cpu.Q6_K
    twin.out_features, twin.in_features = q.shape
    twin.data = torch.from_numpy(q_panels.pack(q, params, linear_q_cpu.Q6_K))
    return twin


@pytest.fixture
def q6_kp():
    if (
        not linear_q_cpu.available()
        or linear_q_cpu.kernel_type(linear_q_cpu.Q6_K) != linear_q_cpu.Q6_KP
    ):
        pytest.skip("Q6_KP runs on CPUs with AVX512-BF16 and AVX512-VBMI only")


@pytest.mark.parametrize("n", [1, 17, 40])
@pytest.mark.parametrize("k", [256, 768])
def test_packing_round_trips_at_the_files_size(n, k):
    raw = _blocks(n, k, seed=n + k)
    q, params = linear_q_cpu.unpack_ggml(raw, linear_q_cpu.Q6_K, k)
    packed = q_panels.pack(q, params, linear_q_cpu.Q6_KP)
    panels = q_panels.num_panels(n)
    assert packed.nbytes == panels * 16 * k * 6.5625 / 8  # Q6_K's 210 bytes per 256, padded N
    assert packed.nbytes == panels * k // 32 * q_panels.record_bytes(linear_q_cpu.Q6_KP)
    got = q_panels.unpack(torch.from_numpy(packed), linear_q_cpu.Q6_KP, n, k)
    assert torch.equal(got, _reference(raw))
    old = q_panels.unpack(torch.from_numpy(q_panels.pack(q, params, linear_q_cpu.Q6_K)), 14, n, k)
    assert torch.equal(got, old)


def test_weights_pack_as_q6_kp_on_this_cpu(q6_kp):
    raw = _blocks(33, 512, seed=3)
    weight = linear_q_cpu.QuantizedWeight(raw, linear_q_cpu.Q6_K, 33, 512)
    assert weight.qtype == linear_q_cpu.Q6_K and weight.kernel_type == linear_q_cpu.Q6_KP
    assert weight.nbytes == q_panels.num_panels(33) * 16 * 512 * 6.5625 / 8
    assert torch.equal(linear_q_cpu.dequantize(weight), _reference(raw))
    with pytest.raises(ValueError, match="multiple of 256"):
        linear_q_cpu.QuantizedWeight(raw.reshape(66, -1), linear_q_cpu.Q6_K, 66, 256 + 32)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7])
def test_bf16_rows_are_exact_on_integer_values(m, q6_kp):
    # d = 1, scales 1, integer x: every product and sum is an integer under 2**24, so the kernel
    # equals the reference whatever its summation order; one misplaced bit of a value shows.
    n, k = 48, 512
    raw = _blocks(n, k, seed=m, d=1.0, unit_scales=True)
    weight = linear_q_cpu.QuantizedWeight(raw, linear_q_cpu.Q6_K, n, k)
    w = _reference(raw)
    x = torch.from_numpy(np.random.default_rng(m).integers(-64, 65, (m, k)).astype(np.float32))
    got = linear_q_cpu.linear(x.to(torch.bfloat16), weight, out_dtype=torch.float32)
    assert torch.equal(got, F.linear(x.double(), w.double()).float())


def test_bf16_rows_are_exact_with_every_scale(q6_kp):
    # the same with random int8 scales (-128 at the extreme) and x in -8..8: sums under 2**24
    n, k = 40, 256
    raw = _blocks(n, k, seed=11, d=1.0)
    raw.reshape(n, 210)[:2, 192:208] = 0x80  # scale -128 in two columns
    weight = linear_q_cpu.QuantizedWeight(raw, linear_q_cpu.Q6_K, n, k)
    x = torch.from_numpy(np.random.default_rng(2).integers(-8, 9, (3, k)).astype(np.float32))
    got = linear_q_cpu.linear(x.to(torch.bfloat16), weight, out_dtype=torch.float32)
    assert torch.equal(got, F.linear(x.double(), _reference(raw).double()).float())


@pytest.mark.parametrize("m", [1, 3, 9, 131])
def test_bf16_rows_sum_as_dequantize_then_matmul(m, q6_kp):
    n, k = (100, 1024) if m == 131 else (37, 512)  # 131: several threads, a remainder tile
    raw = _blocks(n, k, seed=m)
    weight = linear_q_cpu.QuantizedWeight(raw, linear_q_cpu.Q6_K, n, k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2 * k, generator=gen).to(torch.bfloat16)[:, ::2]  # strided bf16 rows
    b = torch.randn(n, generator=gen)
    ref = F.linear(x.double(), _reference(raw).double(), b.double())
    got = linear_q_cpu.linear(x, weight, b, out_dtype=torch.float32)
    torch.testing.assert_close(got.double(), ref, atol=2e-6 * float(ref.abs().max()), rtol=0)
    out = linear_q_cpu.linear(x, weight, b)  # bf16 out
    torch.testing.assert_close(
        out.float(),
        ref.float().to(torch.bfloat16).float(),
        atol=1e-2 * float(ref.abs().max()),
        rtol=1e-2,
    )


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("m", [1, 5, 16, 131])
def test_other_paths_equal_the_q6_k_form_bit_for_bit(m, isa, q6_kp):
    n, k = 70, 512
    raw = _blocks(n, k, seed=m + 1)
    weight = linear_q_cpu.QuantizedWeight(raw, linear_q_cpu.Q6_K, n, k)
    old = _as_q6_k(weight, raw)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen)
    with contextlib.ExitStack() as stack:
        stack.enter_context(linear_q_cpu.use_isa(isa))
        for rows in (x, x.to(torch.bfloat16) if isa == "avx2" else x):  # fp32 rows (bf16: AVX2)
            assert torch.equal(
                linear_q_cpu.linear(rows, weight, b), linear_q_cpu.linear(rows, old, b)
            )
        if isa == "avx512" and linear_q_cpu.int8_available():
            got = linear_q_cpu.linear(x, weight, b, out_dtype=torch.bfloat16, int8_activations=True)
            want = linear_q_cpu.linear(x, old, b, out_dtype=torch.bfloat16, int8_activations=True)
            assert torch.equal(got, want)
