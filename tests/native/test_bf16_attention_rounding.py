"""bf16 on CPU rounds where transformers' bf16 eager forward does (issue 13).

Attention: ``q @ k^T`` rounded to bf16, times the scale, rounded again, softmax in fp32, its
probabilities rounded to bf16, then ``P @ V`` summed in fp32 and rounded once (the kernel's
two-pass bf16 path; its online softmax could not round the normalised weights). Rotary: cos/sin
cast to bf16, each product rounded, then the sum. The references are transformers' own
functions where they exist; the unrounded math, what the kernels did before, is shown to differ.
"""

from __future__ import annotations

import pytest
import torch
from paged_batches import HKV, HQ, SCALE, D, hf_eager_attention, paged_bf16_batch

from trillm.attention.torch_backend import TorchAttentionBackend
from trillm.kernels import paged_attention_cpu

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)


def _attend(q, keys, values, context_len, *, rounded, rounded_probs=False):
    """One request's attention, fp32 softmax and sum: q [Lq, Hq, D], keys/values [S, Hkv, D]
    bf16 -> [Lq, Hq, D] bf16; ``rounded``: the scores at transformers' bf16 rounding points;
    ``rounded_probs``: the probabilities too (what the kernels did before: fp32 ones)."""
    k = keys.float().repeat_interleave(HQ // HKV, 1)
    v = values.float().repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("qhd,shd->hqs", q.float(), k)  # [Hq, Lq, S]
    if rounded:
        scores = (scores.to(torch.bfloat16) * SCALE).to(torch.bfloat16).float()
    else:
        scores = scores * SCALE
    q_pos = context_len + torch.arange(q.shape[0])[:, None]
    scores.masked_fill_(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    probs = scores.softmax(-1)  # [Hq, Lq, S]
    if rounded_probs:
        probs = probs.to(torch.bfloat16).float()
    return torch.einsum("hqs,shd->qhd", probs, v).to(q.dtype)


def _differing(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).float().mean().item()


CASES = [([20, 70, 5], [1, 1, 1]), ([0, 0], [37, 9]), ([0, 30, 12], [20, 1, 7])]


@pytest.mark.parametrize("context_lens,query_lens", CASES, ids=["decode", "fresh-prompts", "mixed"])
def test_bf16_attention_equals_transformers_eager_bit_for_bit(context_lens, query_lens):
    """Through the CPU backend (decode rows, fresh bf16 prompts, later chunks; both kernel
    paths, one-row and tiled): the output equals transformers' ``eager_attention_forward`` to
    the bit, and so does the torch twin. The test can fail: fp32 probabilities (the online
    softmax the kernel had) change a fifth or more of the outputs, fp32 scores more."""
    from trillm.kernels import paged_attention_torch

    meta, cache, q, k, v, per_request = paged_bf16_batch(context_lens, query_lens)
    backend = TorchAttentionBackend(native=True)
    backend.plan(meta)
    out = backend.forward(q, k, v, cache, meta, SCALE)  # [T, Hq, D]
    twin = paged_attention_torch.paged_attention(
        q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, SCALE
    )  # [T, Hq, D]
    starts = meta.query_start_loc.tolist()
    for i, (ctx, slots) in enumerate(per_request):
        keys = cache[0].view(-1, HKV, D)[slots]
        values = cache[1].view(-1, HKV, D)[slots]
        rows = slice(starts[i], starts[i + 1])
        hf = hf_eager_attention(q[rows], keys, values, ctx)
        assert torch.equal(out[rows], hf)
        assert torch.equal(twin[rows], hf)
        fp32_probs = _attend(q[rows], keys, values, ctx, rounded=True)
        fp32_scores = _attend(q[rows], keys, values, ctx, rounded=False, rounded_probs=True)
        assert _differing(fp32_probs, hf) > 0.2
        assert _differing(fp32_scores, hf) > 0.2


def test_bf16_attention_long_context_near_bit_for_bit():
    """Long rows (several key chunks of both kernels, a 1000-key decode row, a 160-row prompt):
    outside the bit-equal cases only fp32 summation order differs (torch's softmax and GEMM sum
    in another order), a few outputs in ten thousand; fp32 probabilities change a third."""
    meta, cache, q, k, v, per_request = paged_bf16_batch([300, 1000, 0], [1, 1, 160], seed=2)
    backend = TorchAttentionBackend(native=True)
    backend.plan(meta)
    out = backend.forward(q, k, v, cache, meta, SCALE)  # [T, Hq, D]
    starts = meta.query_start_loc.tolist()
    for i, (ctx, slots) in enumerate(per_request):
        keys = cache[0].view(-1, HKV, D)[slots]
        values = cache[1].view(-1, HKV, D)[slots]
        rows = slice(starts[i], starts[i + 1])
        hf = hf_eager_attention(q[rows], keys, values, ctx)
        assert _differing(out[rows], hf) < 0.005
        # and by little: a probability or an output rounded the other way at a near-tie (the
        # outputs are O(1); an error in the softmax or the sum would be far larger)
        assert (out[rows].float() - hf.float()).abs().max() <= 2.0**-6
        assert _differing(_attend(q[rows], keys, values, ctx, rounded=True), hf) > 0.2


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_prefill_kernel_equals_transformers_eager(threads, monkeypatch):
    """The fresh-prompt kernel (``causal_prefill``) on bf16 prompts, q/k/v strided views of one
    fused qkv, lengths around its 64-key tiles and 6-row blocks: transformers' eager attention
    up to a few outputs in ten thousand (5.8 on an AVX2-only CPU, whose torch sums in yet
    another order), each within 2^-6 (it sums q . k over the head in another fp32 order than
    the paged kernel); rows between the segments are left alone."""
    if not paged_attention_cpu.prefill_supports_layout(torch.bfloat16, HQ, HKV, D):
        pytest.skip("the CPU has no AVX2/FMA")
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    g = torch.Generator().manual_seed(3)
    lens, gap = [1, 5, 64, 65, 130], 2
    starts = [gap + sum(lens[:i]) + gap * i for i in range(len(lens))]
    rows = starts[-1] + lens[-1] + gap
    qkv = (1.5 * torch.randn(rows, (HQ + 2 * HKV) * D, generator=g)).to(torch.bfloat16)
    q = qkv[:, : HQ * D].view(rows, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(rows, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(rows, HKV, D)
    segments = torch.tensor([[a, n] for a, n in zip(starts, lens)], dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    paged_attention_cpu.causal_prefill(q, k, v, segments, SCALE, out)
    for a, n in zip(starts, lens):
        r = slice(a, a + n)
        hf = hf_eager_attention(q[r], k[r], v[r], 0)
        assert _differing(out[r], hf) < 0.001
        assert (out[r].float() - hf.float()).abs().max() <= 2.0**-6
        if n >= 64:  # the test can fail: fp32 probabilities differ (one key: p = 1 in both)
            assert _differing(_attend(q[r], k[r], v[r], 0, rounded=True), hf) > 0.2
    assert (out[: starts[0]] == 7.0).all() and (out[starts[1] - gap : starts[1]] == 7.0).all()


@pytest.mark.parametrize("twin", ["native", "torch"])
def test_bf16_rotary_equals_transformers_bit_for_bit(twin):
    """bf16 q/k rotated with transformers' rounding points (cos/sin cast to bf16, each product
    rounded, then the sum): equal to its ``apply_rotary_pos_emb`` to the bit; fp32 math with one
    rounding at the end differs on a good share of the elements."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from trillm.kernels import rotary_cpu, rotary_torch
    from trillm.model_executor.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(D, 10000.0, None, 2048, max_positions=2048)
    positions = torch.tensor([0, 3, 17, 255, 1000, 2047])
    q = (3 * torch.randn(6, HQ, D, generator=g)).to(torch.bfloat16)
    k = (3 * torch.randn(6, HKV, D, generator=g)).to(torch.bfloat16)
    table = rotary.cos_sin_cache[positions]  # [T, D] fp32: cos half, sin half
    cos = torch.cat([table[:, : D // 2]] * 2, -1).to(torch.bfloat16)  # [T, D], as HF's
    sin = torch.cat([table[:, D // 2 :]] * 2, -1).to(torch.bfloat16)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    if twin == "native":
        if not rotary_cpu.available():
            pytest.skip("trillm._ext is not built")
        got_q, got_k = q.clone(), k.clone()
        rotary_cpu.apply_rotary_(got_q, got_k, positions, rotary.cos_sin_cache)
    else:
        got_q, got_k = rotary_torch.apply_rotary(q, k, positions, rotary.cos_sin_cache)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # the test can fail: one rounding at the end differs from transformers
    once_q, _ = rotary_torch.apply_rotary(q.float(), k.float(), positions, rotary.cos_sin_cache)
    assert (once_q.to(torch.bfloat16) != want_q).float().mean() > 0.01
