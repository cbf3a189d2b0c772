"""The "avx2" decode kernel (ext/cpu_attention_decode.h with each key / value row widened once
for a block of its GQA group, AVX2 + FMA; what AVX2-only CPUs run for bf16 and fp8 caches, and
AVX512-BF16 ones for fp8 caches; fp32 caches keep the one-row kernel) against the one-row kernel
that widens the rows per query vector (``paged_decode_kernel("one-row")``) and against an fp64
reference: q fp32 / bf16, caches bf16 / fp8 e4m3, GQA groups 1/4/8 (and 3: a partial block of
vectors), head dims 64/128, block sizes 1/5/16/32, sliding windows, soft caps, a NaN-filled
unused cache, 1-3 threads. Every lane sums in the one-row kernel's order: bf16 q gives the same
bits; with fp32 q (no bf16 rounding of the scores to absorb it) the compiled code of the two
rounds sums apart where it contracts a product and a sum into an FMA differently: up to a few
ulps of an O(1) output (within 4e-6)."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode_attention import attention_ext as _ext
from tests.support.decode_attention import decode_problem as _problem
from tests.support.decode_attention import fp64_reference as _fp64_reference
from tests.support.decode_attention import run_decode as _run
from trillm.kernels import paged_attention_cpu, paged_attention_torch

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)

CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
QS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _check(problem, *, window=None, softcap=None):
    """avx2 vs one-row (the same bits, or 1 ulp for fp32 q at head dim 128) and vs fp64."""
    new = _run(problem, "avx2", window=window, softcap=softcap)
    old = _run(problem, "one-row", window=window, softcap=softcap)
    assert not new.isnan().any()
    q = problem[0]
    if q.dtype == torch.float32:
        torch.testing.assert_close(new, old, rtol=0, atol=4e-6)
    else:
        assert torch.equal(new, old)
    ref = _fp64_reference(problem, window, softcap)
    # bf16 q: transformers' rounding points (scores and probabilities rounded to bf16)
    tol = 2e-5 if q.dtype == torch.float32 else 4e-2
    torch.testing.assert_close(new.double(), ref, rtol=0, atol=tol)
    return new


SEQ_LENS = [1, 2, 15, 16, 17, 31, 33, 64, 65, 100, 300]


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("q_dtype", sorted(QS))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(8, 8, 64), (32, 8, 64), (16, 2, 64), (12, 4, 128), (8, 1, 128)]
)
def test_matches_one_row_kernel_and_fp64(heads, kv_heads, head_dim, q_dtype, cache):
    problem = _problem(
        SEQ_LENS,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        q_dtype=QS[q_dtype],
        cache_dtype=CACHES[cache],
    )
    new = _check(problem)
    # the test can fail: another cache's values change the output
    q, kv, *rest = problem
    other = (q, kv.flip(0), *rest)  # keys and values swapped
    assert (new.float() - _run(other, "avx2").float()).abs().max() > 0.1


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_block_sizes_and_tails(block_size, cache):
    problem = _problem(
        [1, 3, 16, 47, 129],
        heads=32,
        kv_heads=8,
        head_dim=64,
        q_dtype=torch.float32,
        cache_dtype=CACHES[cache],
        block_size=block_size,
        seed=2,
    )
    _check(problem)


@pytest.mark.parametrize("window,softcap", [(9, None), (None, 1.5), (40, 30.0), (1, None)])
@pytest.mark.parametrize("q_dtype", sorted(QS))
def test_sliding_window_and_softcap(window, softcap, q_dtype):
    problem = _problem(
        [1, 8, 9, 70, 200],
        heads=16,
        kv_heads=4,
        head_dim=64,
        q_dtype=QS[q_dtype],
        cache_dtype=torch.float8_e4m3fn,
        seed=3,
    )
    new = _check(problem, window=window, softcap=softcap)
    # the test can fail: without the window (or cap) the rows differ
    assert not torch.equal(new, _run(problem, "avx2"))


def test_bf16_q_matches_the_torch_twin():
    """bf16 q: transformers' bf16 eager attention's rounding points (the torch twin)."""
    problem = _problem(
        SEQ_LENS,
        heads=32,
        kv_heads=8,
        head_dim=64,
        q_dtype=torch.bfloat16,
        cache_dtype=torch.bfloat16,
    )
    q, kv, qsl, seq_lens, table = problem
    twin = paged_attention_torch.paged_attention(q, kv, qsl, seq_lens, table, 64**-0.5)
    new = _run(problem, "avx2")
    assert (new != twin).float().mean().item() <= 0.01
    assert (new.float() - twin.float()).abs().max().item() <= 2.0**-5


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads, monkeypatch):
    """Batch 1 (one item per kv head) and batch 16 (whole rows per item): the same bits."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "1")
    problems = [
        _problem(
            [s] * b,
            heads=32,
            kv_heads=8,
            head_dim=64,
            q_dtype=torch.bfloat16,
            cache_dtype=torch.float8_e4m3fn,
            seed=4,
        )
        for b, s in ((1, 1025), (16, 300))
    ]
    ref = [_run(p, "avx2") for p in problems]
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    for p, r in zip(problems, ref):
        assert torch.equal(_run(p, "avx2"), r)


def test_fp8_caches_run_avx2_under_bf16_dot_and_fp32_caches_one_row():
    """On an AVX512-BF16 CPU the default ('bf16-dot') sends fp8 caches to 'avx2'; fp32 caches
    (nothing to widen) keep the one-row kernel under either."""
    for q_dtype in (torch.bfloat16, torch.float32):
        fp8, fp32 = (
            _problem([5, 40, 90], heads=8, kv_heads=2, head_dim=64, q_dtype=q_dtype, cache_dtype=c)
            for c in (torch.float8_e4m3fn, torch.float32)
        )
        assert torch.equal(_run(fp8, "bf16-dot"), _run(fp8, "avx2"))
        for kernel in ("bf16-dot", "avx2"):
            assert torch.equal(_run(fp32, kernel), _run(fp32, "one-row"))


def test_generic_keeps_the_fallback():
    """set_kernel('generic') (a CPU without AVX2) runs the fallback one-row kernel: close to the
    avx2 kernel (SSE pairs, no FMA), not necessarily the same bits."""
    problem = _problem(
        [5, 40, 77],
        heads=8,
        kv_heads=2,
        head_dim=64,
        q_dtype=torch.float32,
        cache_dtype=torch.float8_e4m3fn,
    )
    ext = _ext()
    before = ext.get_kernel()
    ext.set_kernel("generic")
    try:
        generic = _run(problem, "avx2")
    finally:
        ext.set_kernel(before)
    torch.testing.assert_close(generic, _run(problem, "avx2"), rtol=0, atol=1e-5)


def test_names_the_kernels():
    ext = _ext()
    with pytest.raises(ValueError, match="one of 'one-row', 'bf16-dot', 'avx2'"):
        ext.paged_decode_kernel("fast")
    assert ext.paged_decode_kernel() in ("bf16-dot", "avx2", "one-row")
