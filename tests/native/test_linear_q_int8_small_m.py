"""The int8-activation quantized GEMM at batched-decode row counts (1 .. 63 rows).

From 16 rows (``ext/cpu_gemm_q.cpp``'s kInt8UnpackedMinRows; the engine's ``INT8_MIN_ROWS``)
the types with one weight scale per block (Q4_0, Q4_1, Q4_G, Q4_K, Q8_0) and the K-quant forms
Q6_KP (GGUF's Q6_K on CPUs with AVX512-BF16 and VBMI), Q5_KM (Q5_K) and Q4_KM (Q3_K, Q2_K) run
the prefill kernel (``ext/cpu_gemm_q_vnni_prefill.h``: each panel pair unpacked once for all
rows) instead of the 4-row ``tile_vnni``; Q6_K's 9-bit records keep ``tile_vnni`` below 64
rows. Checked at every row count 1..63 against the reference (``quantize_activations`` times
the dequantized weight), and row for row bit for bit against a 64-row call (the prefill
kernel) from 16 rows: the same kernel whatever the row count, so a batch's rows do not depend
on how many others share its step. For all but Q4_0 and Q4_G both kernels give the same bits
at every row count, whatever the thread count.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.support.int8_gemm import int8_reference as _reference
from tests.support.int8_gemm import quantized_weight as _weight
from trillm.kernels import linear_q_cpu, q_panels
from trillm.testing.gguf_models import random_kquant_blocks

pytestmark = pytest.mark.skipif(
    not linear_q_cpu.int8_available(), reason="no native kernel or no AVX512-VNNI"
)

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_G", "Q4_K"]
FOUR_BIT = [t for t in TYPES if t != "Q8_0"]
UNPACKED_MIN_ROWS = 16  # ext/cpu_gemm_q.cpp's kInt8UnpackedMinRows
# the K-quant kernel forms from 16 rows: the GGUF type each is packed from
KQUANT_FORMS = {"Q6_KP": "Q6_K", "Q5_KM": "Q5_K", "Q4_KM": "Q3_K"}


@pytest.mark.parametrize("type_name", TYPES)
def test_every_row_count_is_the_rounded_activations_times_the_weight(type_name):
    n, k = 45, 512 if type_name == "Q4_K" else 160  # N past a pair, K of several blocks
    weight = _weight(type_name, n, k, seed=3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(63, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    ref = _reference(x, weight, bias)
    scale = float(ref.abs().max())
    for m in range(1, 64):
        got = linear_q_cpu.linear(x[:m], weight, bias, int8_activations=True)
        torch.testing.assert_close(
            got, ref[:m], atol=2e-6 * scale * k**0.5, rtol=1e-5, msg=lambda e, m=m: f"{m} rows: {e}"
        )


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("k", [256, 2304])  # one pass of K; two (2,048 and 256 values)
def test_from_16_rows_each_row_is_the_prefill_kernels_bit_for_bit(type_name, k):
    weight = _weight(type_name, 70, k, seed=k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    full = linear_q_cpu.linear(x, weight, out_dtype=torch.float32, int8_activations=True)
    for m in (UNPACKED_MIN_ROWS, 17, 19, 32, 48, 63):
        got = linear_q_cpu.linear(x[:m], weight, out_dtype=torch.float32, int8_activations=True)
        assert torch.equal(got, full[:m]), f"{type_name}, {m} rows"


def test_q4_0_small_and_unpacked_kernels_are_exact_on_integer_sums():
    # weight scales 1 and x on the int8 grid: every sum is an integer, so both kernels (15 rows:
    # tile_vnni; 16: unpacked) give the exact product; Q4_0's offset 8 taken out either way
    gen = torch.Generator().manual_seed(7)
    n, k = 40, 96
    q = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
    blocks = torch.cat(
        [torch.tensor([0x00, 0x3C], dtype=torch.uint8).expand(n, k // 32, 2), q], dim=2
    )  # d = fp16 1.0
    weight = linear_q_cpu.QuantizedWeight(blocks.reshape(n, -1).numpy(), linear_q_cpu.Q4_0, n, k)
    x = torch.randint(-127, 128, (16, k), generator=gen).float()
    x.view(16, k // 16, 16)[:, :, 0] = 127.0  # each half block's absmax 127: dx 1, xq = x
    exact = torch.nn.functional.linear(x.double(), linear_q_cpu.dequantize(weight).double()).float()
    for m in (15, 16):
        assert torch.equal(linear_q_cpu.linear(x[:m], weight, int8_activations=True), exact[:m])


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("form", list(KQUANT_FORMS))
def test_kquant_forms_every_row_count_and_from_16_rows_the_prefill_kernels_bits(form, threads):
    # N past two pairs and not a multiple of 32; K in two passes (2,048 and 256 values) of
    # whole super-blocks; rows strided (a view of wider rows, not from their start), bf16
    gguf_type = KQUANT_FORMS[form]
    n, k = 70, 2304
    raw = random_kquant_blocks(gguf_type, n, k, seed=11)
    weight = linear_q_cpu.QuantizedWeight(raw, int(GGMLQuantizationType[gguf_type]), n, k)
    if weight.kernel_type != getattr(linear_q_cpu, form):
        pytest.skip(f"{form}: this CPU packs {gguf_type} otherwise")
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(64, k + 40, generator=gen).bfloat16()[:, 24 : 24 + k]
    assert x.stride(0) == k + 40
    full = linear_q_cpu.linear(x, weight, out_dtype=torch.float32, int8_activations=True)
    ref = _reference(x.float(), weight)
    torch.testing.assert_close(full, ref, atol=2e-6 * float(ref.abs().max()) * k**0.5, rtol=1e-5)
    # from 16 rows the same kernel; below, tile_vnni: for these types the same integer sums and
    # the same fp32 steps per half block, so the same bits too
    for m in range(1, 64):
        got = linear_q_cpu.linear(x[:m], weight, out_dtype=torch.float32, int8_activations=True)
        kernel = "prefill" if m >= UNPACKED_MIN_ROWS else "tile_vnni"
        assert torch.equal(got, full[:m]), f"{form}, {threads} threads, {m} rows ({kernel})"


# tile_vnni and the prefill kernel take the same integer sums and the same fp32 steps for these
# (Q4_0 and Q4_G take their offsets out otherwise): the GGUF type each K-quant form is packed
# from, None for the types quantized_weight makes
SAME_BITS = {
    "Q4_1": None,
    "Q8_0": None,
    "Q4_K": None,
    "Q6_K": "Q6_K",
    "Q6_KP": "Q6_K",
    "Q4_KM": "Q3_K",
    "Q5_KM": "Q5_K",
}


def _same_bits_weight(form: str, n: int, k: int):
    gguf_type = SAME_BITS[form]
    if gguf_type is None:
        return _weight(form, n, k, seed=21)
    raw = random_kquant_blocks(gguf_type, n, k, seed=21)
    weight = linear_q_cpu.QuantizedWeight(raw, int(GGMLQuantizationType[gguf_type]), n, k)
    if form == "Q6_K" and weight.kernel_type != linear_q_cpu.Q6_K:  # the 9-bit records
        q, params = linear_q_cpu.unpack_ggml(raw, linear_q_cpu.Q6_K, k)
        weight.kernel_type = linear_q_cpu.Q6_K
        weight.data = torch.from_numpy(q_panels.pack(q, params, linear_q_cpu.Q6_K))
    if weight.kernel_type != getattr(linear_q_cpu, form):
        pytest.skip(f"{form}: this CPU packs {gguf_type} otherwise")
    return weight


@pytest.fixture
def unpacked_from():
    """The native module's private hook: int8 rows run the prefill kernel from `rows` on, every
    type (1: always; 64: tile_vnni below 64); each type's own threshold restored after."""
    ext = linear_q_cpu._ext()
    yield ext._set_int8_unpacked_min_rows
    ext._set_int8_unpacked_min_rows(0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("form", list(SAME_BITS))
def test_both_kernels_same_bits_at_every_row_count_and_thread_count(form, unpacked_from):
    # N past two pairs and not a multiple of 32, K in two passes (2,048 and 256 values), rows
    # strided bf16, a NaN in row 5; fp32 out with a bias and bf16 out; 1-3 threads (the
    # prefill kernel's runs of pairs, each prefetching its next pair, split otherwise)
    n, k = 70, 2304
    weight = _same_bits_weight(form, n, k)
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(70, k + 40, generator=gen).bfloat16()[:, 24 : 24 + k]
    x[5, 100] = float("nan")
    bias = torch.randn(n, generator=gen)
    cases = ((torch.float32, bias), (torch.bfloat16, None))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = [
            linear_q_cpu.linear(x, weight, b, out_dtype=o, int8_activations=True) for o, b in cases
        ]
        assert bool(full[0][5].isnan().all()) and not bool(full[0][4].isnan().any())
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in range(1, 71):
                for (out_dtype, b), whole in zip(cases, full):
                    for rows in (64, 1):  # tile_vnni below 64 rows; the prefill kernel always
                        unpacked_from(rows)
                        got = linear_q_cpu.linear(
                            x[:m], weight, b, out_dtype=out_dtype, int8_activations=True
                        )
                        assert torch.equal(_bits(got), _bits(whole[:m])), (
                            f"{form}, {threads} threads, {m} rows, {out_dtype}, from {rows}"
                        )
    finally:
        torch.set_num_threads(previous)
