"""TorchAttentionBackend against a per-request reference on a randomly filled paged cache, on
both of its paths: the native CPU kernel (requests with context) and the torch gather path;
fresh prompts take the ``is_causal`` fast path on both."""

from __future__ import annotations

import pytest
import torch
from paged_batches import attention_metadata

from trillm.attention.torch_backend import TorchAttentionBackend
from trillm.kernels import paged_attention_cpu

HQ, HKV, D, BS, NUM_BLOCKS = 8, 2, 16, 4, 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference(q, k, v, cache_before, meta, block_tables, scale, window=None, softcap=None):
    out = torch.empty_like(q, dtype=torch.float64)
    qsl = meta.query_start_loc.tolist()
    for i, table in enumerate(block_tables):
        ctx, seq = meta.context_lens[i].item(), meta.seq_lens[i].item()
        slots = [table[p // BS] * BS + p % BS for p in range(ctx)]
        rows = slice(qsl[i], qsl[i + 1])
        keys = torch.cat([cache_before[0].view(-1, HKV, D)[slots], k[rows]]).double()
        values = torch.cat([cache_before[1].view(-1, HKV, D)[slots], v[rows]]).double()
        keys = keys.repeat_interleave(HQ // HKV, 1)  # [S, Hq, D]
        values = values.repeat_interleave(HQ // HKV, 1)
        scores = torch.einsum("qhd,shd->hqs", q[rows].double(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos_q, pos_k = torch.arange(ctx, seq)[:, None], torch.arange(seq)[None, :]
        hidden = pos_k > pos_q
        if window is not None:
            hidden |= pos_k <= pos_q - window  # a window of W sees W positions, its own included
        scores = scores.masked_fill(hidden, float("-inf"))
        out[rows] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), values)
    return out


@pytest.fixture(params=["native", "torch"])
def path(request) -> str:
    if request.param == "native" and not paged_attention_cpu.available():
        pytest.skip("trillm._ext.cpu_kernels is not built")
    return request.param


def _run(path: str | None, context_lens, query_lens, seed=0, window=None, softcap=None):
    # path: "native" or "torch", None for the backend's own default.
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    block_tables, used = [], 0
    for c, q in zip(context_lens, query_lens):
        n = -(-(c + q) // BS)
        block_tables.append(perm[used : used + n])
        used += n
    meta = attention_metadata(context_lens, query_lens, block_tables)
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=g)
    before = cache.clone()
    t = meta.num_tokens
    q = torch.randn(t, HQ, D, generator=g)
    k, v = torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
    backend = TorchAttentionBackend(native=None if path is None else path == "native")
    backend.plan(meta)
    out = backend.forward(q, k, v, cache, meta, D**-0.5, window=window, softcap=softcap)
    ref = _reference(q, k, v, before, meta, block_tables, D**-0.5, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The new K/V landed at their slots, nothing else moved.
    for i in (0, 1):
        flat = cache[i].view(-1, HKV, D)
        assert torch.equal(flat[meta.slot_mapping], (k, v)[i])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[meta.slot_mapping] = False
        assert torch.equal(flat[untouched], before[i].view(-1, HKV, D)[untouched])
    return backend, meta, (q, k, v)


@pytest.mark.parametrize(
    "context_lens,query_lens",
    [
        ([5, 0, 13, 7], [1, 1, 1, 1]),  # decode only
        ([0, 3, 9], [6, 11, 4]),  # prefill chunks, one after a prefix
        ([10, 0, 4, 17, 2], [1, 9, 1, 5, 1]),  # mixed: two groups
        ([0, 0, 0], [5, 9, 3]),  # fresh prompts only
        ([4, 0, 7, 0], [1, 6, 1, 1]),  # decodes, a fresh prompt, a one-token prompt
        ([0, 6, 0, 3], [7, 5, 2, 1]),  # fresh, continued chunk, fresh, decode
        ([0], [13]),  # one fresh prompt spanning blocks
        ([40, 0, 3], [30, 1, 20]),  # long chunk after a prefix: several row tiles
    ],
    ids=[
        "decode",
        "prefill",
        "mixed",
        "fresh",
        "fresh-decode",
        "all-kinds",
        "single",
        "long-chunks",
    ],
)
def test_matches_reference(path, context_lens, query_lens):
    _run(path, context_lens, query_lens)


@pytest.mark.parametrize(
    "window,softcap", [(5, None), (1, None), (None, 0.5), (7, 2.0)], ids=["w5", "w1", "cap", "both"]
)
@pytest.mark.parametrize(
    "context_lens,query_lens",
    [([10, 0, 4, 17, 2], [1, 9, 1, 5, 1]), ([0, 0], [13, 3]), ([40, 0, 3], [30, 1, 20])],
    ids=["mixed", "fresh", "long-chunks"],
)
def test_sliding_window_and_softcap_match_reference(
    path, context_lens, query_lens, window, softcap
):
    _run(path, context_lens, query_lens, window=window, softcap=softcap)


def test_windowed_and_plain_layers_share_a_step(path):
    """Alternating layers (Gemma 2): a windowed layer between two plain ones gives each its own
    answer from the one plan."""
    backend, meta, (q, k, v) = _run(path, [0, 9, 0], [12, 1, 4], seed=2)
    g = torch.Generator().manual_seed(9)
    for window in (3, None):
        cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=g)
        got = backend.forward(q, k, v, cache.clone(), meta, D**-0.5, window=window)
        fresh = TorchAttentionBackend(native=False)
        fresh.plan(meta)
        expected = fresh.forward(q, k, v, cache.clone(), meta, D**-0.5, window=window)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # on CPU the windowed layer ran the native paged kernel (the plain ones their own plan)
    assert (backend._native_all is not None) == (path == "native")


def test_every_layer_reuses_the_plan(path):
    """The same metadata in a second layer (another cache) gives that layer's answer too."""
    backend, meta, (q, k, v) = _run(path, [0, 5, 0], [6, 1, 4], seed=1)
    g = torch.Generator().manual_seed(7)
    cache2 = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=g)
    out2 = backend.forward(q, k, v, cache2.clone(), meta, scale=D**-0.5)
    fresh = TorchAttentionBackend(native=path == "native")
    fresh.plan(meta)
    torch.testing.assert_close(out2, fresh.forward(q, k, v, cache2.clone(), meta, D**-0.5))


def test_a_default_backend_plans_the_native_kernel_on_cpu_when_built():
    """Without the ``native`` argument a CPU decode step goes to the native kernel exactly when
    it is built (and enabled), to the gather groups otherwise."""
    backend, _, _ = _run(None, [5, 9], [1, 1])
    if paged_attention_cpu.available():
        assert backend._native is not None and not backend._groups
    else:
        assert backend._native is None and backend._groups
