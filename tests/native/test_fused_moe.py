"""The mixture-of-experts FFN: the torch reference against a per-token loop written from the
definition (and transformers' router semantics), and the native CPU grouped path against the
reference. The Triton kernel is checked in tests/native/test_kernels.py (interpreter); the models in
tests/models/test_model_moe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trillm.kernels import fused_moe_cpu, fused_moe_torch


def _data(tokens, experts, top_k, seed, hidden=48, inter=40, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    return x, w13, w2, logits


def _per_token(x, w13, w2, logits, top_k, renormalize):
    """out_t = sum over the top-k experts e of p_e * down_e(silu(gate_e x_t) * up_e x_t)."""
    inter = w2.shape[2]
    out = torch.zeros_like(x, dtype=torch.float64)
    probs = torch.softmax(logits.double(), -1)
    for t in range(x.shape[0]):
        top = torch.topk(probs[t], top_k)
        weights = top.values / top.values.sum() if renormalize else top.values
        for w, e in zip(weights.tolist(), top.indices.tolist()):
            gate, up = w13[e, :inter].double(), w13[e, inter:].double()
            h = F.silu(gate @ x[t].double()) * (up @ x[t].double())
            out[t] += w * (w2[e].double() @ h)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (23, 6, 2), (11, 3, 1)])
def test_reference_matches_the_definition(tokens, experts, top_k, renormalize):
    x, w13, w2, logits = _data(tokens, experts, top_k, tokens + experts)
    weights, ids = fused_moe_torch.select_experts(logits, top_k, renormalize)
    got = fused_moe_torch.fused_moe(x, w13, w2, weights, ids)
    want = _per_token(x, w13, w2, logits, top_k, renormalize)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


needs_native = pytest.mark.skipif(
    not fused_moe_cpu.available(), reason="the native packed GEMM is not available"
)


@needs_native
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (64, 8, 2), (17, 5, 3)])
def test_native_grouped_path_matches_the_reference(tokens, experts, top_k):
    x, w13, w2, logits = _data(tokens, experts, top_k, 7 * tokens + experts)
    logits[:, 1] -= 100.0  # an expert with no tokens
    weights, ids = fused_moe_torch.select_experts(logits, top_k, renormalize=True)
    want = fused_moe_torch.fused_moe(x, w13, w2, weights, ids)
    with torch.inference_mode():
        assert fused_moe_cpu.supports(x, w13)
        got = fused_moe_cpu.fused_moe(x, fused_moe_cpu.PackedExperts(w13, w2), weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_layer_reloads_experts_after_packing():
    from trillm.model_executor.layers.fused_moe import FusedMoE

    x, w13, w2, logits = _data(5, 4, 2, 3)
    layer = FusedMoE(4, 2, 48, 40, renormalize=True)
    layer.load_fused("gate_up_proj", w13)
    layer.load_fused("down_proj", w2)
    assert layer.missing() == []
    with torch.inference_mode():
        first = layer(x, logits)
        layer.load_expert(2, "down", torch.zeros(48, 40))  # drops the packed copy
        second = layer(x, logits)
    w2_new = w2.clone()
    w2_new[2] = 0
    weights, ids = fused_moe_torch.select_experts(logits, 2, True)
    torch.testing.assert_close(second, fused_moe_torch.fused_moe(x, w13, w2_new, weights, ids))
    assert not torch.equal(first, second) or not (ids == 2).any()
