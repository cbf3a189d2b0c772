"""The quantized kernel's batch-1 path (one fp32 row: decode's GEMVs) for Q4_0 / Q4_1 / Q8_0.

Each output's fp32 additions run in a fixed order whatever the tile's rows, the thread count or
the work split, and the one-row tile prefetches the records ahead of it (past its panels' end at
the last pair: a prefetch never faults). So a row alone must give bit for bit what it gives
among three or four rows, on 1-3 threads; and each within an fp64 reference's tolerance.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from trillm.kernels import linear_q_cpu

QTYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


@pytest.fixture(autouse=True)
def _native():
    if not linear_q_cpu.available():
        pytest.skip("trillm._ext.cpu_kernels not built or no AVX2/FMA/F16C")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _weight(qtype, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_1:
        w += rng.uniform(-1, 1, (n, 1)).astype(np.float32)  # blocks with a nonzero minimum
    raw = quants.quantize(w, qtype)
    dq = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float64))
    return linear_q_cpu.QuantizedWeight(raw, int(qtype), n, k), dq


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(1, 32), (17, 32), (33, 96), (70, 576), (200, 1536), (1000, 64)])
def test_one_row_is_the_row_among_others_on_any_thread_count(qtype, n, k):
    weight, dq = _weight(qtype, n, k, seed=n + k)
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(4, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    torch.set_num_threads(1)
    among = linear_q_cpu.linear(x, weight, bias)  # the 4-row tile
    among3 = linear_q_cpu.linear(x[:3], weight, bias)  # the 3-row tile
    ref = x.double() @ dq.T + bias.double()
    torch.testing.assert_close(among.double(), ref, atol=2e-4 * k**0.5, rtol=1e-4)
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for r in range(4):
            alone = linear_q_cpu.linear(x[r : r + 1], weight, bias)
            assert torch.equal(alone[0], among[r]), (threads, r)
            if r < 3:
                assert torch.equal(alone[0], among3[r]), (threads, r)
            bf16 = linear_q_cpu.linear(x[r : r + 1], weight, bias, out_dtype=torch.bfloat16)
            assert torch.equal(
                bf16[0], among[r].to(torch.bfloat16)
            )  # one rounding, to nearest even


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_one_nan_row_spoils_only_itself(qtype):
    n, k = 70, 576
    weight, dq = _weight(qtype, n, k, seed=7)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    x[1, 100] = float("nan")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        clean = linear_q_cpu.linear(x[:1], weight)
        spoiled = linear_q_cpu.linear(x[1:], weight)
        assert torch.isnan(spoiled).all()
        assert torch.equal(clean, linear_q_cpu.linear(x, weight)[:1])
        torch.testing.assert_close(
            clean[0].double(), dq @ x[0].double(), atol=2e-4 * k**0.5, rtol=1e-4
        )


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(17, 32), (70, 576), (1000, 64)])
def test_one_bf16_row_on_any_thread_count(qtype, n, k):
    # a bf16 row runs the vdpbf16ps path where the CPU has it (Q4 types; its sums' order
    # depends on the tile's rows): the same bits on 1-3 threads, within fp64's tolerance
    weight, dq = _weight(qtype, n, k, seed=n * k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    torch.set_num_threads(1)
    first = linear_q_cpu.linear(x, weight, bias, out_dtype=torch.float32)
    ref = x.double() @ dq.T + bias.double()
    torch.testing.assert_close(first.double(), ref, atol=2e-4 * k**0.5, rtol=1e-4)
    for threads in (2, 3):
        torch.set_num_threads(threads)
        assert torch.equal(linear_q_cpu.linear(x, weight, bias, out_dtype=torch.float32), first)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(17, 32), (70, 576), (1000, 64)])
def test_one_row_on_the_avx2_kernel(qtype, n, k):
    # the AVX2 kernel's one-row path (row_direct, the same prefetch): the same bits on 1-3
    # threads, within fp64's tolerance
    weight, dq = _weight(qtype, n, k, seed=n + 2 * k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(linear_q_cpu.use_isa("avx2"))
        except RuntimeError as err:  # this CPU lacks it
            pytest.skip(str(err))
        torch.set_num_threads(1)
        first = linear_q_cpu.linear(x, weight, bias)
        ref = x.double() @ dq.T + bias.double()
        torch.testing.assert_close(first.double(), ref, atol=2e-4 * k**0.5, rtol=1e-4)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(linear_q_cpu.linear(x, weight, bias), first)
