"""The int8-activation quantized GEMM with a NaN or an infinity in its activations.

Each row of x is rounded to int8 per half block of 16 with dx = absmax / 127
(``ext/cpu_gemm_q_vnni.h``'s quantize_rows). A NaN has no absmax: the vector max may skip it and
round the half block as if it were absent, turning the row's outputs finite. A half block with a
NaN or an infinity gets dx NaN instead, so that row's outputs are all NaN (as the reference
``quantize_activations`` and the fp32 path's NaN x give) and every other row is untouched. Checked
on every int8 kernel: ``tile_vnni`` (1 and 5 rows; Q8_0 to 63), the unpacked kernel from 16 rows
(4-bit types) and the prefill kernel from 64 (all types, Q6_K as this CPU packs it and the K-quants
repacked as Q4_KM / Q5_KM), fp32 and bf16 rows.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.int8_gemm import int8_reference, quantized_weight
from trillm.kernels import linear_q_cpu
from trillm.testing.gguf_models import random_kquant_blocks

pytestmark = pytest.mark.skipif(
    not linear_q_cpu.int8_available(), reason="no native kernel or no AVX512-VNNI"
)

K_QUANTS = {"Q6_K": linear_q_cpu.Q6_K, "Q5_K": linear_q_cpu.Q5_K, "Q3_K": linear_q_cpu.Q3_K}


@functools.cache
def _weight(type_name: str, n: int, k: int):
    if type_name in K_QUANTS:
        raw = random_kquant_blocks(type_name, n, k, 3)
        return linear_q_cpu.QuantizedWeight(raw, K_QUANTS[type_name], n, k)
    return quantized_weight(type_name, n, k, seed=3)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_G", "Q4_K", *K_QUANTS])
@pytest.mark.parametrize("m", [1, 5, 16, 70])  # tile_vnni, its 4-row tail; unpacked; prefill
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_activation_makes_its_row_nan(type_name, m, bad, dtype):
    n, k = 40, 512
    weight = _weight(type_name, n, k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    row = m // 2
    x[row, 37] = bad  # one value of one half block, the rest of its half block finite
    x = x.to(dtype)
    got = linear_q_cpu.linear(x, weight, out_dtype=torch.float32, int8_activations=True)
    assert torch.isnan(got[row]).all(), f"row {row}: {got[row]}"
    ref = int8_reference(x.float(), weight)
    assert torch.isnan(ref[row]).all()  # the reference agrees
    others = torch.cat([got[:row], got[row + 1 :]])
    clean = torch.cat([x[:row], x[row + 1 :]])
    if len(clean):  # the other rows are what they are without the bad one
        alone = linear_q_cpu.linear(clean, weight, out_dtype=torch.float32, int8_activations=True)
        assert torch.isfinite(others).all()
        scale = float(alone.abs().max())
        torch.testing.assert_close(others, alone, atol=1e-6 * scale * k**0.5, rtol=1e-5)


def test_a_nan_in_each_half_block_position():
    # every lane of a half block, both halves of a block: the vector max's order cannot hide it
    weight = quantized_weight("Q4_0", 32, 64, seed=1)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    for lane in range(64):
        x[lane, lane] = float("nan")
    for m in (64, 15):  # the prefill kernel; tile_vnni
        got = linear_q_cpu.linear(x[:m], weight, int8_activations=True)
        assert torch.isnan(got).all(dim=1).all(), torch.isnan(got).all(dim=1)
