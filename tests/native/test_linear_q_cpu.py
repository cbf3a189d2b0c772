"""kernels/linear_q_cpu.py: GGUF Q4_0 / Q4_1 / Q8_0 / Q2_K .. Q6_K weights kept quantized (issue 13).

The repacked layout is checked against the gguf package's own dequantizer (an independent
reader of GGML blocks); the native kernel against dequantize-then-F.linear on random blocks,
edge shapes included, each kernel this CPU runs (AVX-512's, and the AVX2 one everywhere: the
``isa`` fixture); the portable path (no extension) against the same reference.
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

QTYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """Each kernel this CPU runs: AVX-512's where it has AVX512F/BW/VL, the AVX2 one anywhere."""
    if not linear_q_cpu.available():
        pytest.skip("trillm._ext.cpu_kernels not built or no AVX2/FMA/F16C")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(linear_q_cpu.use_isa(request.param))
        except RuntimeError as err:  # this CPU lacks it
            pytest.skip(str(err))
        yield request.param


def test_the_kernel_runs_on_every_avx2_cpu():
    # torch's own dispatch level: "AVX2" on an AVX2/FMA CPU (F16C with it on every such x86
    # CPU), "AVX512" with AVX-512; the native kernel must run on both, not fall back to torch.
    from trillm._native import native_module

    if native_module("cpu_kernels") is None:
        pytest.skip("trillm._ext.cpu_kernels not built")
    level = torch.backends.cpu.get_cpu_capability()
    if level not in ("AVX2", "AVX512"):
        pytest.skip(f"torch reports {level}")
    assert linear_q_cpu.available()
    assert linear_q_cpu.isa() == ("avx512" if level == "AVX512" else "avx2")
    with linear_q_cpu.use_isa("avx2"):
        assert linear_q_cpu.isa() == "avx2"
        assert not linear_q_cpu.int8_available()  # int8 activations: the AVX-512 kernel only
    with pytest.raises(ValueError, match="'avx2' or 'avx512'"):
        with linear_q_cpu.use_isa("sse"):
            pass


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


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 64])
@pytest.mark.parametrize("n", [1, 15, 33, 70])
def test_kernel_matches_dequantize_then_matmul(qtype, m, n, isa):
    _check(qtype, m, n, 64, torch.float32, torch.float32, bias=n % 2 == 1)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("x_dtype", "out_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_kernel_bf16_activations_and_outputs(qtype, x_dtype, out_dtype, isa):
    _check(qtype, 9, 37, 128, x_dtype, out_dtype, bias=True)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_kernel_large_threaded_call_and_strided_rows(qtype, isa):
    # Over the 1-MFLOP threshold: several threads, row blocks of 64 and a remainder tile.
    _check(qtype, 131, 96, 576, torch.float32, torch.float32, bias=False)
    raw, w = _weight(qtype, 40, 64)
    weight = linear_q_cpu.QuantizedWeight(raw, int(qtype), 40, 64)
    x = torch.randn(6, 128)[:, ::2]  # rows with a stride, last dim not contiguous
    torch.testing.assert_close(linear_q_cpu.linear(x, weight), F.linear(x, w), atol=2e-3, rtol=1e-4)


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


# ---------------------------------------------------------------- int8 activations (VNNI)

needs_vnni = pytest.mark.skipif(
    not linear_q_cpu.int8_available(), reason="no native kernel or no AVX512-VNNI"
)


def test_quantize_activations_rounds_each_half_block_to_int8():
    x = torch.randn(3, 48)
    x[1, 16:32] = 0.0  # a half block of zeros stays zeros
    xq = linear_q_cpu.quantize_activations(x)
    blocks, qblocks = x.view(3, 3, 16), xq.view(3, 3, 16)
    dx = blocks.abs().amax(dim=2, keepdim=True) / 127
    assert bool(((qblocks - blocks).abs() <= dx / 2 + 1e-7).all())
    codes = torch.where(dx > 0, qblocks / torch.where(dx > 0, dx, 1), 0)
    torch.testing.assert_close(codes, codes.round(), atol=1e-4, rtol=0)  # integers
    assert bool((codes.abs().amax(dim=2) > 126.99).view(-1)[[0, 1, 2, 3, 5, 6, 7, 8]].all())
    assert bool((qblocks[1, 1] == 0).all())


def _check_int8(qtype, m, n, k, bias, out_dtype=torch.float32):
    raw, w = _weight(qtype, n, k, seed=m + n)
    weight = linear_q_cpu.QuantizedWeight(raw, int(qtype), n, k)
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = linear_q_cpu.linear(x, weight, b, out_dtype=out_dtype, int8_activations=True)
    xq = linear_q_cpu.quantize_activations(x)
    ref = F.linear(xq, w, b)  # the rounded activations times the dequantized weight
    if out_dtype == torch.bfloat16:
        torch.testing.assert_close(got, ref.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
        return
    torch.testing.assert_close(got, ref, atol=2e-4 * k**0.5, rtol=1e-4)
    # against fp32 activations: within what rounding x can change, sum_k |W[n, k]| * dx / 2
    dx = x.view(m, k // 16, 16).abs().amax(dim=2) / 127  # [m, K/16]
    bound = (w.abs().view(n, k // 16, 16).sum(dim=2) @ (dx / 2).T).T  # [m, n]
    assert bool(((got - F.linear(x, w, b)).abs() <= bound + 1e-4).all())


@needs_vnni
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 131])
@pytest.mark.parametrize("n", [15, 70])
def test_int8_kernel_is_the_rounded_activations_times_the_weight(qtype, m, n):
    _check_int8(qtype, m, n, 576 if m == 131 else 128, bias=n % 2 == 1)


@needs_vnni
def test_int8_kernel_bf16_output_and_group_zero_points():
    _check_int8(GGMLQuantizationType.Q4_0, 9, 37, 128, bias=True, out_dtype=torch.bfloat16)
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, (40, 128)).astype(np.uint8)
    s = (rng.random((40, 2)) * 0.1 + 0.01).astype(np.float16)
    z = rng.integers(0, 16, (40, 2)).astype(np.uint8)
    weight = linear_q_cpu.QuantizedWeight.from_groups(q, s, z)  # Q4_G, groups of 64
    x = torch.randn(6, 128)
    got = linear_q_cpu.linear(x, weight, int8_activations=True)
    ref = F.linear(linear_q_cpu.quantize_activations(x), linear_q_cpu.dequantize(weight))
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_int8_portable_path_is_the_reference(qtype, monkeypatch):
    monkeypatch.setenv("TRILLM_NO_EXTENSIONS", "1")
    assert not linear_q_cpu.int8_available()
    _check_int8(qtype, 3, 20, 64, bias=True)


@needs_vnni
def test_int8_q8_0_kernel_is_exact_at_the_extremes():
    # Q8_0 blocks of any bytes (-128 too, which GGML's quantizer never writes but a file may
    # hold) and activations that round to +-127: the sign-flip trick (q + 128, then 128 sum(xq)
    # taken out) must leave the integer dot products exact. Scales of 1 and x already on the
    # int8 grid (dx 1): the kernel's sums are integers, equal to the reference's exactly.
    rng = np.random.default_rng(5)
    n, k = 37, 128
    blocks = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
    blocks[:2, :, 2:] = 0x80  # two columns of all -128
    blocks[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    weight = linear_q_cpu.QuantizedWeight(blocks.reshape(n, -1), 8, n, k)
    x = torch.from_numpy(rng.integers(-127, 128, (7, k)).astype(np.float32))
    x.view(7, k // 16, 16)[:, :, 0] = 127.0  # every half block's absmax is 127: dx = 1, xq = x
    x[3] = -127.0
    got = linear_q_cpu.linear(x, weight, int8_activations=True)
    ref = F.linear(x.double(), linear_q_cpu.dequantize(weight).double()).float()
    assert torch.equal(got, ref)


# ---------------------------------------------------------------- K-quants (super-blocks of 256)

# type -> (its id, offsets of its fp16 d (and dmin), their magnitude for O(1) values, bits a
# value once packed). Q5_K runs as the Q5_KM packed form, Q3_K and Q2_K as Q4_KM's, Q6_K as
# Q6_KP's (6.5625 bits) where the CPU has AVX512-BF16 and VBMI.
KQUANTS = {
    "Q4_K": (linear_q_cpu.Q4_K, (0, 2), 2e-3, 5.5),
    "Q6_K": (linear_q_cpu.Q6_K, (208,), 5e-4, 9),
    "Q3_K": (linear_q_cpu.Q3_K, (108,), 8e-3, 6),
    "Q5_K": (linear_q_cpu.Q5_K, (0, 2), 1e-3, 7),
    "Q2_K": (linear_q_cpu.Q2_K, (80, 82), 2e-2, 6),
}


def _kquant_weight(type_name: str, n: int, k: int, seed: int = 0):
    """Random K-quant blocks (every bit pattern is valid), d / dmin of either sign chosen so the
    values are O(1), and their values as the gguf package dequantizes them."""
    _, offsets, scale, _ = KQUANTS[type_name]
    raw = random_kquant_blocks(type_name, n, k, seed)
    blocks = raw.reshape(n * k // 256, -1)
    rng = np.random.default_rng(seed + 1)
    for at in offsets:
        d = rng.uniform(-scale, scale, len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    values = quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)
    return raw, torch.from_numpy(values)


@pytest.mark.parametrize("type_name", list(KQUANTS))
@pytest.mark.parametrize("n", [1, 17, 33])
def test_kquant_packed_layout_dequantizes_like_gguf(type_name, n):
    qtype, _, _, bits = KQUANTS[type_name]
    raw, expected = _kquant_weight(type_name, n, 512, seed=n)
    weight = linear_q_cpu.QuantizedWeight(raw, qtype, n, 512)
    assert weight.qtype == qtype
    assert weight.kernel_type == linear_q_cpu.kernel_type(qtype)
    if weight.kernel_type == linear_q_cpu.Q6_KP:  # Q6_K at the file's size (AVX512-BF16 CPUs)
        bits = 6.5625
    assert weight.nbytes == q_panels.num_panels(n) * 16 * 512 * bits / 8
    assert torch.equal(linear_q_cpu.dequantize(weight), expected)
    with pytest.raises(ValueError, match="multiple of 256"):
        linear_q_cpu.QuantizedWeight(raw.reshape(2 * n, -1), qtype, 2 * n, 256 + 32)


def _check_kquant(type_name, m, n, k, int8, out_dtype=torch.float32, bias=False):
    raw, w = _kquant_weight(type_name, n, k, seed=m + n)
    weight = linear_q_cpu.QuantizedWeight(raw, KQUANTS[type_name][0], n, k)
    gen = torch.Generator().manual_seed(m * 3 + n)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = linear_q_cpu.linear(x, weight, b, out_dtype=out_dtype, int8_activations=int8)
    ref = F.linear(linear_q_cpu.quantize_activations(x) if int8 else x, w, b)
    if out_dtype == torch.bfloat16:
        torch.testing.assert_close(got, ref.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got, ref, atol=2e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("type_name", list(KQUANTS))
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 131])
@pytest.mark.parametrize("n", [15, 70])
def test_kquant_kernel_matches_dequantize_then_matmul(type_name, m, n, isa):
    _check_kquant(type_name, m, n, 512 if m == 131 else 256, int8=False, bias=n % 2 == 1)


@pytest.mark.parametrize("type_name", ["Q3_K", "Q5_K", "Q2_K"])
def test_repacked_kquant_kernel_bf16_and_strided_rows(type_name, isa):
    _check_kquant(type_name, 9, 37, 256, int8=False, out_dtype=torch.bfloat16, bias=True)
    raw, w = _kquant_weight(type_name, 33, 256, seed=4)
    weight = linear_q_cpu.QuantizedWeight(raw, KQUANTS[type_name][0], 33, 256)
    x = torch.randn(6, 512)[:, ::2].to(torch.bfloat16)  # bf16 rows with a stride
    torch.testing.assert_close(
        linear_q_cpu.linear(x, weight, out_dtype=torch.float32),
        F.linear(x.float(), w),
        atol=2e-3,
        rtol=1e-4,
    )


@needs_vnni
@pytest.mark.parametrize("type_name", list(KQUANTS))
@pytest.mark.parametrize("m", [1, 5, 16, 131])
def test_kquant_int8_kernel_is_the_rounded_activations_times_the_weight(type_name, m):
    _check_kquant(type_name, m, 37, 512, int8=True, bias=True)
    _check_kquant(type_name, m, 37, 256, int8=True, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("type_name", list(KQUANTS))
def test_kquant_portable_path_without_extensions(type_name, monkeypatch):
    monkeypatch.setenv("TRILLM_NO_EXTENSIONS", "1")
    _check_kquant(type_name, 3, 20, 256, int8=False, bias=True)
    _check_kquant(type_name, 3, 20, 256, int8=True)


@needs_vnni
def test_q6_k_int8_kernel_at_the_extremes():
    # Q6_K's int8 path weighs each half block's integer sum by its int8 scale in integers: the
    # largest products (q = -32, scale -128, xq = -127) must neither overflow nor round before
    # the conversion. d = 1 and x on the int8 grid (dx = 1): every block sum is an integer.
    rng = np.random.default_rng(9)
    n, k = 20, 512
    blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    blocks[:3, :, 0:192] = 0  # q = -32 throughout
    blocks[:3, :, 192:208] = 0x80  # scales -128
    blocks[:, :, 208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    weight = linear_q_cpu.QuantizedWeight(blocks.reshape(n, -1), linear_q_cpu.Q6_K, n, k)
    x = torch.from_numpy(rng.integers(-127, 128, (5, k)).astype(np.float32))
    x.view(5, k // 16, 16)[:, :, 0] = 127.0  # every half block's absmax is 127: dx = 1, xq = x
    x[2] = -127.0
    got = linear_q_cpu.linear(x, weight, int8_activations=True)
    ref = F.linear(x.double(), linear_q_cpu.dequantize(weight).double())
    assert ref[2, 0] == -32 * 128 * 127 * k  # the extreme row and column
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


@needs_vnni
@pytest.mark.parametrize("type_name", ["Q5_K", "Q3_K"])
def test_q5_k_q3_k_int8_kernel_at_the_extremes(type_name):
    # Q5_K with every bit set (q = 31 through the fifth-bit mask, scale and minimum 63) and Q3_K
    # with q = -4 and scale -32 (stored as q + 4 = 0 with the minimum 4 * -32 = -128, the int8
    # floor) in three columns, random blocks in the rest; d = dmin = 1 and x on the int8 grid
    # (dx = 1): the block sums are integers, the kernel's must equal the reference's.
    rng = np.random.default_rng(11)
    n, k = 20, 512
    size, d_at = (176, (0, 2)) if type_name == "Q5_K" else (110, (108,))
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    blocks[:3] = 0xFF if type_name == "Q5_K" else 0
    for at in d_at:
        blocks[:, :, at : at + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    weight = linear_q_cpu.QuantizedWeight(blocks.reshape(n, -1), KQUANTS[type_name][0], n, k)
    w = linear_q_cpu.dequantize(weight).double()
    assert float(w[0, 0]) == (63 * 31 - 63 if type_name == "Q5_K" else 128)
    x = torch.from_numpy(rng.integers(-127, 128, (5, k)).astype(np.float32))
    x.view(5, k // 16, 16)[:, :, 0] = 127.0  # every half block's absmax is 127: dx = 1, xq = x
    x[2] = -127.0
    got = linear_q_cpu.linear(x, weight, int8_activations=True)
    ref = F.linear(x.double(), w)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
    fp32 = linear_q_cpu.linear(x, weight)  # the fp32 path at the same extremes
    torch.testing.assert_close(fp32.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_K", "Q3_K"])
def test_kquant_fp32_kernel_at_the_extremes(type_name, isa):
    # The largest values each form holds (Q6_K: q = -32, scale -128; Q5_K: q = 31 through the
    # fifth-bit mask, scale and minimum 63; Q3_K: q = -4, scale -32, stored as 0 with the minimum
    # -128) in three columns, random blocks in the rest, d = dmin = 1, x on the int8 grid: every
    # product is an integer, so the kernel's sums may differ from the exact ones by fp32's
    # summation bound alone (K roundings of 2^-24 of sum |x w|); one wrong bit or overflow would
    # cost at least 16 * 127 * 63 (Q5_K), far beyond it.
    rng = np.random.default_rng(13)
    n, k = 20, 512
    size, d_at, top = {
        "Q6_K": (210, (208,), 0),
        "Q5_K": (176, (0, 2), 0xFF),
        "Q3_K": (110, (108,), 0),
    }[type_name]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    blocks[:3] = top
    if type_name == "Q6_K":
        blocks[:3, :, 192:208] = 0x80  # scales -128
    for at in d_at:
        blocks[:, :, at : at + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    weight = linear_q_cpu.QuantizedWeight(blocks.reshape(n, -1), KQUANTS[type_name][0], n, k)
    w = linear_q_cpu.dequantize(weight).double()
    assert float(w[0, 0]) == {"Q6_K": -32 * -128, "Q5_K": 63 * 31 - 63, "Q3_K": 128}[type_name]
    x = torch.from_numpy(rng.integers(-127, 128, (5, k)).astype(np.float32))
    x[2] = -127.0
    for rows in (x[:1], x):  # the one-row path and the dequantized one
        ref = F.linear(rows.double(), w)
        bound = k * 2.0**-24 * F.linear(rows.double().abs(), w.abs())
        assert bool(((linear_q_cpu.linear(rows, weight).double() - ref).abs() <= bound).all())


def test_kernel_results_do_not_depend_on_the_thread_count(isa):
    raw, _ = _weight(GGMLQuantizationType.Q4_1, 70, 576)
    weight = linear_q_cpu.QuantizedWeight(raw, int(GGMLQuantizationType.Q4_1), 70, 576)
    x = torch.randn(131, 576, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = linear_q_cpu.linear(x, weight)
        torch.set_num_threads(2)
        assert torch.equal(linear_q_cpu.linear(x, weight), alone)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------- bf16 activations, 4-bit types (AVX512-BF16 + VBMI)
# Rows that come in bf16 (fp32 activations, not int8) run `vdpbf16ps` over the nibbles where
# the CPU has AVX512-BF16 and AVX512-VBMI (ext/cpu_gemm_q_bf16.h): the same exact products as
# the fp32 rows' FMAs, summed in another order. Elsewhere they take the fp32 kernel, and these
# tests check that instead.
def _q4_weight(type_name: str, n: int, k: int, seed: int):
    if type_name == "Q4_K":
        return _kquant_weight(type_name, n, k, seed)
    if type_name == "Q4_G":
        rng = np.random.default_rng(seed)
        q = rng.integers(0, 16, (n, k)).astype(np.uint8)
        scales = rng.uniform(-0.1, 0.1, (n, k // 64)).astype(np.float16)
        zeros = rng.integers(0, 16, (n, k // 64)).astype(np.uint8)
        weight = linear_q_cpu.QuantizedWeight.from_groups(q, scales, zeros)
        return weight, linear_q_cpu.dequantize(weight)
    return _weight(GGMLQuantizationType[type_name], n, k, seed)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q4_G"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9, 131])
def test_bf16_rows_sum_as_their_fp32_values_do(type_name, m, isa):
    n, k = (96, 512) if m == 131 else (37, 256)  # 131: several threads, a remainder tile
    raw, w = _q4_weight(type_name, n, k, seed=m)
    weight = (
        raw
        if type_name == "Q4_G"
        else linear_q_cpu.QuantizedWeight(
            raw,
            KQUANTS[type_name][0] if type_name == "Q4_K" else int(GGMLQuantizationType[type_name]),
            n,
            k,
        )
    )
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2 * k, generator=gen).to(torch.bfloat16)[:, ::2]  # strided bf16 rows
    b = torch.randn(n, generator=gen)
    got = linear_q_cpu.linear(x, weight, b, out_dtype=torch.float32)
    same = linear_q_cpu.linear(x.float(), weight, b)  # the fp32 kernel on the same values
    ref = F.linear(x.double(), w.double(), b.double())
    scale = float(ref.abs().max())
    torch.testing.assert_close(got.double(), ref, atol=2e-6 * scale, rtol=0)
    torch.testing.assert_close(got, same, atol=2e-6 * scale, rtol=0)
    torch.testing.assert_close(
        linear_q_cpu.linear(x, weight, b).float(),
        ref.float().to(torch.bfloat16).float(),
        atol=1e-2 * scale,
        rtol=1e-2,
    )


def test_bf16_rows_are_exact_on_integer_values(isa):
    # Q4_0 with d = 1 over random bytes (every nibble at every position) and integer x: every
    # product and sum is an integer under 2**24, so the kernel's sums equal the reference's
    # exactly, whatever their order; a wrong nibble, pair or column shows as a miss.
    n, k = 48, 512
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    raw = blocks.reshape(n, -1)
    weight = linear_q_cpu.QuantizedWeight(raw, int(GGMLQuantizationType.Q4_0), n, k)
    w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_0).astype(np.float32))
    for m in (1, 4, 7):
        x = torch.from_numpy(rng.integers(-64, 65, (m, k)).astype(np.float32))
        got = linear_q_cpu.linear(x.to(torch.bfloat16), weight, out_dtype=torch.float32)
        assert torch.equal(got, F.linear(x.double(), w.double()).float())
