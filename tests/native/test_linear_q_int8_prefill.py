"""The int8-activation quantized GEMM at prefill row counts (ext/cpu_gemm_q_vnni_prefill.h).

From 64 rows (all but Q6_K from 16: tests/native/test_linear_q_int8_small_m.py) the types
with one weight scale per block (Q4_0, Q4_1, Q4_G, Q4_K, Q8_0) run a second kernel: a pair of
panels unpacked once per 256 rows, 4-row register blocks. Checked
against the reference (``quantize_activations`` times the dequantized weight) at its edges: row
counts that are not a multiple of the register block or cross a 256-row item, a single panel
(the pair's second all padding), N not a multiple of 32, K of one block, K in two passes; against the small-row
kernel row for row (the same integer sums, only the fp32 order may differ); exactly where every
sum is an integer; bf16 rows rounded as their fp32 widening is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from int8_gemm import int8_reference, quantized_weight

from trillm.kernels import linear_q_cpu, q_panels
from trillm.testing.gguf_models import random_kquant_blocks

pytestmark = pytest.mark.skipif(
    not linear_q_cpu.int8_available(), reason="no native kernel or no AVX512-VNNI"
)

PREFILL_MIN_ROWS = 64  # ext/cpu_gemm_q_vnni_prefill.h's kPrefillMinRows
UNPACKED_MIN_ROWS = 16  # all but Q6_K's (ext/cpu_gemm_q.cpp's kInt8UnpackedMinRows)


TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_G", "Q4_K"]


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (64, 16, 32),  # the fewest rows, one panel (its pair's second is padding), one block
        (67, 45, 96),  # rows past the register block, N not a multiple of the pair's 32
        (259, 32, 64),  # a second 256-row item of 3 rows
        (66, 20, 2112),  # K in two passes (2,048 and 64 values): partial sums kept between
    ],
)
def test_prefill_kernel_is_the_rounded_activations_times_the_weight(type_name, m, n, k):
    k = -(-k // 256) * 256 if type_name == "Q4_K" else k  # super-blocks of 256
    weight = quantized_weight(type_name, n, k, seed=m + n)
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if n % 2 else None
    got = linear_q_cpu.linear(x, weight, bias, int8_activations=True)
    ref = int8_reference(x, weight, bias)
    scale = float(ref.abs().max())
    torch.testing.assert_close(got, ref, atol=2e-6 * scale * k**0.5, rtol=1e-5)
    # row for row the small-row kernel's results: the same integer sums and scales
    rows = UNPACKED_MIN_ROWS - 1  # the most rows tile_vnni runs
    few = linear_q_cpu.linear(x[:rows], weight, bias, int8_activations=True)
    torch.testing.assert_close(got[:rows], few, atol=1e-6 * scale * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_prefill_kernel_is_exact_where_every_sum_is_an_integer(type_name):
    # scales of 1 and x on the int8 grid (each half block's absmax 127: dx = 1, xq = x): every
    # product and sum is an integer well inside fp32's, so the result is exact. Q8_0 bytes of
    # every value (-128 too) exercise the sign flip, Q4_0 the offset 8 taken out in integers.
    rng = np.random.default_rng(11)
    n, k, m = 45, 128, 70
    size = 34 if type_name == "Q8_0" else 18
    blocks = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    if type_name == "Q8_0":
        blocks[:2, :, 2:] = 0x80  # two columns of all -128
    blocks[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    qtype = int(GGMLQuantizationType[type_name])
    weight = linear_q_cpu.QuantizedWeight(blocks.reshape(n, -1), qtype, n, k)
    x = torch.from_numpy(rng.integers(-127, 128, (m, k)).astype(np.float32))
    x.view(m, k // 16, 16)[:, :, 0] = 127.0
    x[3] = -127.0
    got = linear_q_cpu.linear(x, weight, int8_activations=True)
    ref = F.linear(x.double(), linear_q_cpu.dequantize(weight).double()).float()
    assert torch.equal(got, ref)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_prefill_kernel_bf16_rows_and_output(type_name):
    weight = quantized_weight(type_name, 40, 128, seed=5)
    x = torch.randn(80, 256)[:, ::2].to(torch.bfloat16)  # bf16 rows with a stride
    got = linear_q_cpu.linear(x, weight, out_dtype=torch.float32, int8_activations=True)
    # bf16 rows are rounded as their exact fp32 widening: the same result bit for bit
    widened = linear_q_cpu.linear(x.float(), weight, int8_activations=True)
    assert torch.equal(got, widened)
    out = linear_q_cpu.linear(x, weight, int8_activations=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, widened.to(torch.bfloat16))


def test_prefill_kernel_zero_rows_and_half_blocks():
    # a row of zeros, and half blocks of zeros (dx 0: xq 0), give exactly the other half's share
    weight = quantized_weight("Q4_0", 33, 64, seed=2)
    x = torch.randn(65, 64)
    x[0] = 0.0
    x[1, :16] = 0.0
    x[2, 16:] = 0.0
    got = linear_q_cpu.linear(x, weight, int8_activations=True)
    assert bool((got[0] == 0).all())
    ref = int8_reference(x, weight)
    torch.testing.assert_close(got, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("packed", ["Q6_K", "Q6_KP"])
def test_prefill_kernel_q6_k_is_tile_vnni_bit_for_bit(packed):
    # Q6_K (a weight scale per half block, q + 128 as Q8_0 runs) from 64 rows: the same integer
    # sums and the same fp32 steps as tile_vnni (below 64 rows), so row for row the same bits;
    # Q6_KP (AVX512-BF16 / VBMI CPUs) expanded to Q6_K's records once per item. K in two passes
    # (2,048 and 256 values), rows past a register block, N not a multiple of the pair's 32.
    n, k, m = 45, 2304, 70
    raw = random_kquant_blocks("Q6_K", n, k, seed=4)
    weight = linear_q_cpu.QuantizedWeight(raw, linear_q_cpu.Q6_K, n, k)
    if packed == "Q6_K":  # the 9-bit records every CPU without Q6_KP packs
        q, params = linear_q_cpu.unpack_ggml(raw, linear_q_cpu.Q6_K, k)
        weight.kernel_type = linear_q_cpu.Q6_K
        weight.data = torch.from_numpy(q_panels.pack(q, params, linear_q_cpu.Q6_K))
    elif weight.kernel_type != linear_q_cpu.Q6_KP:
        pytest.skip("Q6_KP runs on CPUs with AVX512-BF16 and AVX512-VBMI only")
    # Q6_KP: from 16 rows through the prefill kernel (tests/native/test_linear_q_int8_small_m.py)
    few = PREFILL_MIN_ROWS - 1 if packed == "Q6_K" else UNPACKED_MIN_ROWS - 1
    _assert_tile_vnni_row_for_row(weight, m, n, k, few)


def _assert_tile_vnni_row_for_row(weight, m: int, n: int, k: int, few: int) -> None:
    """m >= 64 rows through the prefill kernel: each row's bits those of tile_vnni (its most
    rows, `few`), and close to the reference."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    got = linear_q_cpu.linear(x, weight, bias, int8_activations=True)
    assert torch.equal(got[:few], linear_q_cpu.linear(x[:few], weight, bias, int8_activations=True))
    assert torch.equal(got[few:], linear_q_cpu.linear(x[few:], weight, bias, int8_activations=True))
    ref = int8_reference(x, weight, bias)
    torch.testing.assert_close(got, ref, atol=2e-6 * float(ref.abs().max()) * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("type_name", ["Q5_K", "Q3_K", "Q2_K"])
def test_prefill_kernel_half_block_minimum_types_are_tile_vnni_bit_for_bit(type_name):
    # Q5_K (packed as Q5_KM: the fifth bits as masks) and Q3_K / Q2_K (as Q4_KM): a scale and a
    # minimum per half block, each half's fp32 step as tile_vnni's add_half_min: the same bits
    n, k, m = 45, 2304, 70
    raw = random_kquant_blocks(type_name, n, k, seed=5)
    qtype = int(GGMLQuantizationType[type_name])
    weight = linear_q_cpu.QuantizedWeight(raw, qtype, n, k)
    _assert_tile_vnni_row_for_row(weight, m, n, k, UNPACKED_MIN_ROWS - 1)  # from 16: prefill
