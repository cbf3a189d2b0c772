"""Attention sinks (gpt-oss) in the native CPU paged-attention kernel (fp32): each query head's
sink logit folded into its finished online softmax equals the torch reference's extra softmax
column, on the decode kernels (head_dim 64, 128), the tile kernel (other head sizes, several
query rows), with a sliding window, on the generic fallback too; bf16 and malformed sinks are
refused."""

from __future__ import annotations

import pytest
import torch
from paged_batches import sink_problem

from trillm.kernels import paged_attention_cpu, paged_attention_torch

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)

CASES = {
    "decode": ([1, 1, 1, 1], [1, 9, 17, 70]),
    "mixed": ([1, 13, 1, 5], [40, 13, 9, 30]),  # a fresh prompt, a chunk after context
}


def _problem(query_lens, seq_lens, heads, kv_heads, head_dim):
    return sink_problem(query_lens, seq_lens, heads, kv_heads, head_dim, block_size=8, seed=3)


def _both(q, kv, qsl, seq_lens, table, sinks, window=None):
    scale = q.shape[-1] ** -0.5
    out = paged_attention_cpu.paged_attention(
        q, kv, qsl, seq_lens, table, scale, window=window, sinks=sinks
    )
    ref = paged_attention_torch.paged_attention(
        q, kv, qsl, seq_lens, table, scale, window=window, sinks=sinks
    )
    return out, ref


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 1, 128), (6, 2, 16)])
@pytest.mark.parametrize("window", [None, 6])
def test_sinks_match_the_reference(case, heads, kv_heads, head_dim, window):
    problem = _problem(*CASES[case], heads, kv_heads, head_dim)
    out, ref = _both(*problem, window=window)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    without = paged_attention_torch.paged_attention(
        *problem[:5], problem[0].shape[-1] ** -0.5, window=window
    )
    assert not torch.allclose(out, without, atol=1e-3)  # the sinks change the output


@pytest.mark.parametrize("head_dim", [64, 16])
def test_generic_fallback_takes_sinks_too(head_dim):
    if paged_attention_cpu.kernel() != "avx2":
        pytest.skip("the generic kernel is the one in use: covered above")
    with paged_attention_cpu.use_kernel("generic"):
        out, ref = _both(*_problem(*CASES["mixed"], 8, 2, head_dim))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def test_bf16_and_malformed_sinks_are_refused():
    q, kv, qsl, seq_lens, table, sinks = _problem(*CASES["decode"], 8, 2, 64)
    bad = {
        "bf16 q": (q.bfloat16(), kv.bfloat16(), sinks),
        "bf16 sinks": (q, kv, sinks.bfloat16()),
        "wrong length": (q, kv, sinks[:4]),
    }
    for name, (qq, cache, ss) in bad.items():
        assert not paged_attention_cpu.supports_sinks(qq, ss), name
        with pytest.raises(ValueError, match="sinks must be"):
            paged_attention_cpu.paged_attention(qq, cache, qsl, seq_lens, table, 0.1, sinks=ss)
