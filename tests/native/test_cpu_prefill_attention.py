"""The native causal kernel for fresh prompts (ext/cpu_prefill_attention.cpp) against torch's
``scaled_dot_product_attention(is_causal=True)`` per prompt: head layouts, head sizes, prompt
lengths around its tile edges, strided views of a fused qkv, thread counts, bad inputs, and its
use by the attention backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trillm.kernels import paged_attention_cpu

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available()
    or not paged_attention_cpu.cpu_kernels("attention").prefill_supported(),
    reason="trillm._ext.cpu_kernels is not built or the CPU has no AVX2/FMA",
)


def _problem(lens, *, heads=8, kv_heads=4, head_dim=64, gap=3, seed=0):
    """q/k/v as strided views of one fused qkv; segments `gap` rows apart (rows between them
    belong to no segment)."""
    g = torch.Generator().manual_seed(seed)
    starts, row = [], gap
    for n in lens:
        starts.append(row)
        row += n + gap
    qkv = torch.randn(row, (heads + 2 * kv_heads) * head_dim, generator=g)
    q = qkv[:, : heads * head_dim].view(row, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(row, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(row, kv_heads, head_dim)
    segments = torch.tensor(list(zip(starts, lens)), dtype=torch.int32).view(-1, 2)
    return q, k, v, segments


def _reference(q, k, v, segments, scale):
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for start, n in segments.tolist():
        rows = slice(start, start + n)
        o = F.scaled_dot_product_attention(
            q[rows].double().transpose(0, 1),
            k[rows].double().transpose(0, 1),
            v[rows].double().transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.transpose(0, 1)
    return out


def _check(lens, **kwargs):
    q, k, v, segments = _problem(lens, **kwargs)
    scale = q.shape[-1] ** -0.5
    out = torch.full(q.shape, -7.0)
    paged_attention_cpu.causal_prefill(q, k, v, segments, scale, out)
    ref = _reference(q, k, v, segments, scale)
    inside = ~ref.isnan()
    torch.testing.assert_close(out.double()[inside], ref[inside], atol=2e-6, rtol=2e-6)
    assert (out[~inside] == -7.0).all(), "rows outside the segments were written"
    return q, k, v, segments, out


@pytest.mark.parametrize(
    "lens",
    [[1], [5, 1, 2], [16, 17], [47, 48, 49], [63, 64, 65], [96, 97], [200], [385, 31]],
    ids=lambda lens: "-".join(map(str, lens)),
)
def test_matches_sdpa_across_tile_edges(lens):
    _check(lens)


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (8, 1), (12, 4), (6, 3), (96, 1)])
def test_head_layouts(heads, kv_heads):
    _check([70, 9], heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("head_dim", [16, 48, 128, 256])
def test_head_sizes(head_dim):
    _check([33, 81], head_dim=head_dim, heads=4, kv_heads=2)


def test_large_scores_stay_finite():
    """Scores in the hundreds: the online softmax's running max keeps exp in range."""
    q, k, v, segments = _problem([150])
    q.mul_(30.0)
    out = torch.empty_like(q)
    paged_attention_cpu.causal_prefill(q, k, v, segments, 1.0, out)
    ref = _reference(q, k, v, segments, 1.0)
    rows = slice(3, 153)
    assert torch.isfinite(out[rows]).all()
    # fp32 scores of magnitude ~1e3 carry ~1e-4 of rounding into the softmax's exponents.
    torch.testing.assert_close(out[rows].double(), ref[rows], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_give_identical_results(monkeypatch, threads):
    """Each work item runs on one thread in a fixed order: bit-identical at any count."""
    q, k, v, segments = _problem([120, 7, 260])
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "1")
    one = paged_attention_cpu.causal_prefill(q, k, v, segments, 0.125, torch.zeros_like(q))
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    many = paged_attention_cpu.causal_prefill(q, k, v, segments, 0.125, torch.zeros_like(q))
    assert torch.equal(one, many)


def test_unsupported_inputs_are_refused():
    q, k, v, segments = _problem([10])
    out = torch.empty_like(q)
    assert not paged_attention_cpu.prefill_supports(q.double(), k.double(), v.double())
    assert not paged_attention_cpu.prefill_supports(q.half(), k.half(), v.half())
    assert not paged_attention_cpu.prefill_supports(q.bfloat16(), k, v)  # mixed dtypes
    q8, k8, v8, _ = _problem([10], head_dim=8)
    assert not paged_attention_cpu.prefill_supports(q8, k8, v8)
    assert not paged_attention_cpu.prefill_supports(q, k[:, :3], v[:, :3])  # 8 % 3 != 0
    with pytest.raises(ValueError, match="unsupported"):
        paged_attention_cpu.causal_prefill(
            q.double(), k.double(), v.double(), segments, 1.0, out.double()
        )
    with pytest.raises(ValueError, match="outside"):
        bad = torch.tensor([[5, q.shape[0]]], dtype=torch.int32)
        paged_attention_cpu.causal_prefill(q, k, v, bad, 1.0, out)
    with pytest.raises(ValueError, match="outside"):
        bad = torch.tensor([[-1, 3]], dtype=torch.int32)
        paged_attention_cpu.causal_prefill(q, k, v, bad, 1.0, out)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_cpu.causal_prefill(q, k, v, segments.long(), 1.0, out)
    with pytest.raises(ValueError, match="same rows"):
        paged_attention_cpu.causal_prefill(q, k[:-1], v[:-1], segments, 1.0, out)


def test_the_backend_sends_fresh_fp32_prompts_to_the_kernel():
    """A CPU fp32 step with fresh prompts plans the kernel's segments (its answer is checked
    against the reference by test_torch_attention); the torch-only backend keeps SDPA."""
    import test_torch_attention as tta

    from trillm.attention.torch_backend import TorchAttentionBackend

    backend, meta, _ = tta._run("native", [0, 4, 0], [9, 1, 20])
    assert backend._fresh == [(0, 9), (10, 30)]
    assert backend._fresh_segments is not None
    assert backend._fresh_segments.tolist() == [[0, 9], [10, 20]]
    torch_only = TorchAttentionBackend(native=False)
    torch_only.plan(meta)
    q = torch.randn(meta.num_tokens, tta.HQ, tta.D)
    k, v = torch.randn(2, meta.num_tokens, tta.HKV, tta.D)
    cache = torch.randn(2, tta.NUM_BLOCKS, tta.BS, tta.HKV, tta.D)
    torch_only.forward(q, k, v, cache, meta, scale=0.1)
    assert torch_only._fresh == backend._fresh and torch_only._fresh_segments is None
