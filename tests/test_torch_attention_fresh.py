"""TorchAttentionBackend's fresh-prompt fast path (prefill chunks without context attend with
``is_causal`` over their own rows) against the per-request reference, in every batch mix."""

from __future__ import annotations

import pytest
import torch
from test_torch_attention import BS, HKV, HQ, NUM_BLOCKS, D, _metadata, _reference

from trillm.attention.torch_backend import TorchAttentionBackend


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _run(context_lens, query_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    block_tables, used = [], 0
    for c, q in zip(context_lens, query_lens):
        n = -(-(c + q) // BS)
        block_tables.append(perm[used : used + n])
        used += n
    meta = _metadata(context_lens, query_lens, block_tables)
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=g)
    before = cache.clone()
    t = meta.num_tokens
    q = torch.randn(t, HQ, D, generator=g)
    k, v = torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
    backend = TorchAttentionBackend()
    backend.plan(meta)
    out = backend.forward(q, k, v, cache, meta, scale=D**-0.5)
    ref = _reference(q, k, v, before, meta, block_tables, D**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache[0].view(-1, HKV, D)[meta.slot_mapping], k)
    assert torch.equal(cache[1].view(-1, HKV, D)[meta.slot_mapping], v)
    return backend, meta, (q, k, v, cache)


@pytest.mark.parametrize(
    "context_lens,query_lens",
    [
        ([0, 0, 0], [5, 9, 3]),  # fresh prompts only
        ([4, 0, 7, 0], [1, 6, 1, 1]),  # decodes, a fresh prompt, a one-token prompt
        ([0, 6, 0, 3], [7, 5, 2, 1]),  # fresh, continued chunk, fresh, decode
        ([0], [13]),  # one fresh prompt spanning blocks
    ],
    ids=["fresh", "fresh-decode", "all-kinds", "single"],
)
def test_fresh_prompts_match_reference(context_lens, query_lens):
    _run(context_lens, query_lens)


def test_every_layer_reuses_the_plan():
    """The same metadata in a second layer (another cache) gives that layer's answer too."""
    backend, meta, (q, k, v, _) = _run([0, 5, 0], [6, 1, 4], seed=1)
    g = torch.Generator().manual_seed(7)
    cache2 = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=g)
    out2 = backend.forward(q, k, v, cache2.clone(), meta, scale=D**-0.5)
    fresh = TorchAttentionBackend()
    fresh.plan(meta)
    torch.testing.assert_close(out2, fresh.forward(q, k, v, cache2.clone(), meta, D**-0.5))
