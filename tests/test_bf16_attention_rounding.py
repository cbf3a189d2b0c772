"""bf16 on CPU rounds where transformers' bf16 eager forward does (issue 13).

Attention: ``q @ k^T`` rounded to bf16, times the scale, rounded again, softmax in fp32 (the
probabilities stay fp32: transformers rounds them to bf16 too, which the online softmax of the
kernel cannot). Rotary: cos/sin cast to bf16, each product rounded, then the sum. The
references are transformers' own functions where they exist; the unrounded (fp32) math, what
the kernels did before, is shown to differ.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from trillm.kernels import paged_attention_cpu

from tests.test_torch_attention import BS, _metadata  # its block size: 4
from trillm.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)

HQ, HKV, D = 6, 2, 64
SCALE = D**-0.5


def _hf_eager(q, keys, values, context_len):
    """transformers' bf16 eager attention of one request: q [Lq, Hq, D], keys/values
    [S, Hkv, D] bf16 -> [Lq, Hq, D] bf16."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    lq, s = q.shape[0], keys.shape[0]
    q_pos = context_len + torch.arange(lq)[:, None]
    mask = torch.zeros(lq, s, dtype=q.dtype)
    mask.masked_fill_(torch.arange(s)[None, :] > q_pos, torch.finfo(q.dtype).min)
    module = SimpleNamespace(num_key_value_groups=HQ // HKV, training=False)
    out, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None], mask[None, None], SCALE,
    )  # fmt: skip  # [1, Lq, Hq, D]
    return out[0]


def _attend(q, keys, values, context_len, *, rounded):
    """One request's attention, fp32 softmax and sum: q [Lq, Hq, D], keys/values [S, Hkv, D]
    bf16 -> [Lq, Hq, D] bf16; ``rounded``: the scores at transformers' bf16 rounding points."""
    k = keys.float().repeat_interleave(HQ // HKV, 1)
    v = values.float().repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("qhd,shd->hqs", q.float(), k)  # [Hq, Lq, S]
    if rounded:
        scores = (scores.to(torch.bfloat16) * SCALE).to(torch.bfloat16).float()
    else:
        scores = scores * SCALE
    q_pos = context_len + torch.arange(q.shape[0])[:, None]
    scores.masked_fill_(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v).to(q.dtype)


def _differing(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).float().mean().item()


@pytest.mark.parametrize(
    "context_lens,query_lens",
    [([20, 70, 5], [1, 1, 1]), ([0, 0], [37, 9]), ([0, 30, 12], [20, 1, 7])],
    ids=["decode", "fresh-prompts", "mixed"],
)
def test_bf16_attention_rounds_scores_like_transformers(context_lens, query_lens):
    """Through the CPU backend (fresh bf16 prompts included): the kernel's output equals the
    rounded-score reference to the bit; fp32 scores change a quarter or more of the outputs,
    and leave them further from transformers' eager attention than the kernel is."""
    g = torch.Generator().manual_seed(0)
    blocks = [-(-(c + q) // BS) for c, q in zip(context_lens, query_lens)]
    perm = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    tables = [perm[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    meta = _metadata(context_lens, query_lens, tables)
    cache = (1.5 * torch.randn(2, sum(blocks) + 2, BS, HKV, D, generator=g)).to(torch.bfloat16)
    t = meta.num_tokens
    q, k, v = ((1.5 * torch.randn(t, h, D, generator=g)).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    backend = TorchAttentionBackend(native=True)
    backend.plan(meta)
    out = backend.forward(q, k, v, cache, meta, SCALE)  # [T, Hq, D]
    starts = meta.query_start_loc.tolist()
    for i, (ctx, table) in enumerate(zip(context_lens, tables)):
        seq = ctx + query_lens[i]
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(seq)])
        keys = cache[0].view(-1, HKV, D)[slots]
        values = cache[1].view(-1, HKV, D)[slots]
        rows = slice(starts[i], starts[i + 1])
        got = out[rows]
        rounded = _attend(q[rows], keys, values, ctx, rounded=True)
        unrounded = _attend(q[rows], keys, values, ctx, rounded=False)
        hf = _hf_eager(q[rows], keys, values, ctx)
        assert _differing(got, rounded) < 0.005  # fp32 summation order only
        assert _differing(unrounded, rounded) > 0.25
        assert _differing(got, hf) < _differing(unrounded, hf)


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
