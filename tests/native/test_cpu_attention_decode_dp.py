"""The bf16 decode kernel on AVX512-BF16 (``paged_decode_kernel("bf16-dot")``:
ext/cpu_attention_decode_dp_slots.h, vdpbf16ps scores for every query vector of the item's kv
heads, each cache slot read once; the same bits as ext/cpu_attention_decode_dp.h's walk per kv
head, test_cpu_attention_decode_dp_slots.py) against the torch twin
(kernels/paged_attention_torch.py, transformers' bf16 rounding points) and the one-row kernel it
replaces for bf16 decode rows (``paged_decode_kernel("one-row")``): GQA groups 1/4/8, head dims
64/128, lengths around its 16-key tiles and the cache's blocks, sliding windows, soft caps, a
NaN-filled unused cache, thread counts. Only the fp32 summation order of q . k differs (pairs),
so a score rounds to the other bf16 neighbour now and then: a few outputs in a thousand, each
by a bf16 step or two of an O(1) value."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode_attention import attention_ext as _attention_ext
from tests.support.decode_attention import decode_problem as _problem
from tests.support.decode_attention import run_decode as _run
from trillm.kernels import paged_attention_cpu, paged_attention_torch

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)


def _assert_near(out, ref, *, share=0.01):
    assert not out.isnan().any()
    differing = (out != ref).float().mean().item()
    assert differing <= share, differing
    assert (out.float() - ref.float()).abs().max().item() <= 2.0**-5


SEQ_LENS = [1, 2, 15, 16, 17, 31, 33, 64, 100, 300]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(8, 8, 64), (32, 8, 64), (16, 2, 64), (9, 3, 64), (8, 2, 128), (8, 1, 128)],
)
def test_matches_torch_twin_and_one_row_kernel(heads, kv_heads, head_dim):
    problem = _problem(SEQ_LENS, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    q, kv, qsl, seq_lens, table = problem
    new = _run(problem, "bf16-dot")
    old = _run(problem, "one-row")
    twin = paged_attention_torch.paged_attention(q, kv, qsl, seq_lens, table, q.shape[-1] ** -0.5)
    _assert_near(new, twin)
    _assert_near(new, old)
    # the test can fail: the cache's values really reach the output
    assert (
        new
        - _run(
            _problem(SEQ_LENS, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=1),
            "bf16-dot",
        )
    ).abs().max() > 0.1


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_block_sizes_and_tails(block_size):
    problem = _problem(
        [1, 3, 16, 47, 129], heads=32, kv_heads=8, head_dim=64, block_size=block_size, seed=2
    )
    _assert_near(_run(problem, "bf16-dot"), _run(problem, "one-row"))


@pytest.mark.parametrize("window,softcap", [(9, None), (None, 1.5), (40, 30.0), (1, None)])
def test_sliding_window_and_softcap(window, softcap):
    problem = _problem([1, 8, 9, 70, 200], heads=16, kv_heads=4, head_dim=64, seed=3)
    q, kv, qsl, seq_lens, table = problem
    new = _run(problem, "bf16-dot", window=window, softcap=softcap)
    twin = paged_attention_torch.paged_attention(
        q, kv, qsl, seq_lens, table, q.shape[-1] ** -0.5, window=window, softcap=softcap
    )
    _assert_near(new, twin)
    _assert_near(new, _run(problem, "one-row", window=window, softcap=softcap))
    # the test can fail: without the window (or cap) the rows differ
    assert not torch.equal(new, _run(problem, "bf16-dot"))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads, monkeypatch):
    """Batch 1 (one item per kv head) and batch 16 (whole rows per item): every thread count
    gives the same bits."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "1")
    one = [
        _problem([s] * b, heads=32, kv_heads=8, head_dim=64, seed=4)
        for b, s in ((1, 1025), (16, 300))
    ]
    ref = [_run(p, "bf16-dot") for p in one]
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    for p, r in zip(one, ref):
        assert torch.equal(_run(p, "bf16-dot"), r)


def test_fp32_and_mixed_dtypes_keep_their_kernel():
    """fp32 q, or an fp32 cache, never take the bf16 decode kernel: the same bits with it on
    or off."""
    q, kv, qsl, seq_lens, table = _problem(
        [5, 40], heads=8, kv_heads=2, head_dim=64, nan_fill=False
    )
    for problem in (
        (q.float(), kv.float(), qsl, seq_lens, table),
        (q.float(), kv, qsl, seq_lens, table),
    ):
        assert torch.equal(_run(problem, "bf16-dot"), _run(problem, "one-row"))


def test_refuses_unknown_kernel_names():
    with pytest.raises(ValueError, match="decode kernel"):
        _attention_ext().paged_decode_kernel("fast")
