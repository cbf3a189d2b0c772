"""The paged kernel's long bf16 chunks with context on AVX512-BF16 (``vdpbf16ps``,
ext/cpu_attention_paged_dp.h): the later chunks of a long prompt, read from the block-paged
cache in 64-key tiles with the fresh-prompt kernel's arithmetic, against transformers' eager
attention and against the tile kernel (``paged_bf16_dot(False)``) it replaces for them.

Both round where transformers' bf16 eager attention does; they differ only in the fp32 order of
the sums, so a few outputs in ten thousand round the other way. Chunks shorter than 16 rows
(speculative verification), windowed or soft-capped layers, fp32 and fp8 caches keep the tile
kernel bit for bit. On a CPU without AVX512-BF16 the switch stays off (the tests of the new path
skip).
"""

from __future__ import annotations

import pytest
import torch
from paged_batches import HKV, HQ, SCALE, D, hf_eager_attention

from trillm.kernels import paged_attention_cpu

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)


@pytest.fixture
def dot_setting():
    """Yields a setter of the switch (-> whether the dot path is on after it); restores it."""
    ext = paged_attention_cpu.cpu_kernels("attention")
    before = ext.paged_bf16_dot(True)
    ext.paged_bf16_dot(before)

    def set_to(on: bool) -> bool:
        ext.paged_bf16_dot(on)
        return ext.paged_bf16_dot(on)  # the setting now (the CPU may refuse True)

    yield set_to
    ext.paged_bf16_dot(before)


def _batch(context_lens, query_lens, hq, hkv, d, block_size, seed, dtype=torch.bfloat16):
    """A random paged batch, every position's key and value already in the cache: (q, cache,
    query_start_loc, seq_lens, block table, per request (context, slots of its positions))."""
    g = torch.Generator().manual_seed(seed)
    seqs = [c + n for c, n in zip(context_lens, query_lens)]
    blocks = [-(-s // block_size) for s in seqs]
    perm = (torch.randperm(sum(blocks) + 3, generator=g)[: sum(blocks)]).tolist()
    table = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    per_request = []
    for i, n in enumerate(blocks):
        row = perm[sum(blocks[:i]) : sum(blocks[:i]) + n]
        table[i, :n] = torch.tensor(row, dtype=torch.int32)
        slots = torch.tensor(
            [row[p // block_size] * block_size + p % block_size for p in range(seqs[i])]
        )
        per_request.append((context_lens[i], slots))
    cache = (1.5 * torch.randn(2, sum(blocks) + 3, block_size, hkv, d, generator=g)).to(dtype)
    q = (1.5 * torch.randn(sum(query_lens), hq, d, generator=g)).to(torch.bfloat16)
    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return q, cache, qsl, torch.tensor(seqs, dtype=torch.int32), table, per_request


def _run(q, cache, qsl, seqs, table, scale, **kw):
    plan = paged_attention_cpu.PagedAttentionPlan(qsl, seqs, table, q.shape, cache.shape)
    return plan.run(q, cache, scale, None, **kw)


def test_the_dot_path_is_on_where_the_cpu_has_avx512_bf16(dot_setting):
    from trillm.kernels import linear_cpu

    assert dot_setting(True) == linear_cpu.available_bf16()
    assert dot_setting(False) is False


@pytest.mark.parametrize("threads", [1, 2])
def test_long_chunks_equal_transformers_eager(threads, dot_setting, monkeypatch):
    """Chunks of 16 .. 130 rows (the path's shortest, the 32-row blocks of 3 query heads a kv
    head, 64-key tiles, odd key counts) after 0 .. 257 cached positions (blocks of 4: chunk
    starts inside a block and on its edge): transformers' eager attention up to a few outputs in
    ten thousand, each within 2^-6; the tile kernel's outputs likewise. The test can fail: the
    dot path sums in another order than the tile kernel, and does so here (it ran)."""
    if not dot_setting(True):
        pytest.skip("the CPU has no AVX512-BF16")
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    contexts, lens = [0, 1, 3, 64, 100, 257, 5], [16, 17, 33, 65, 130, 64, 1]
    batch = _batch(contexts, lens, HQ, HKV, D, block_size=4, seed=11)
    q, cache, qsl, seqs, table, per_request = batch
    dot = _run(q, cache, qsl, seqs, table, SCALE)
    dot_setting(False)
    plain = _run(q, cache, qsl, seqs, table, SCALE)
    starts = qsl.tolist()
    for i, (ctx, slots) in enumerate(per_request):
        r = slice(starts[i], starts[i + 1])
        keys, values = cache[0].view(-1, HKV, D)[slots], cache[1].view(-1, HKV, D)[slots]
        hf = hf_eager_attention(q[r], keys, values, ctx)
        for out in (dot[r], plain[r]):
            assert (out != hf).float().mean().item() < 0.001
            assert (out.float() - hf.float()).abs().max() <= 2.0**-6
    assert torch.equal(dot[-1:], plain[-1:])  # the one-row request: the decode kernel in both
    assert not torch.equal(dot, plain)


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (4, 4, 128), (6, 2, 48), (3, 1, 256)], ids=str)
def test_the_two_paths_agree_across_head_layouts(hq, hkv, d, dot_setting):
    """Groups of 1 .. 4 query heads (GQA), head sizes 48 .. 256, block size 16, one chunk after
    a long context and one in a mixed step with decode rows: equal but for the fp32 order of
    the sums; the decode rows bit for bit."""
    if not dot_setting(True):
        pytest.skip("the CPU has no AVX512-BF16")
    batch = _batch([300, 40, 9], [70, 1, 1], hq, hkv, d, block_size=16, seed=7)
    q, cache, qsl, seqs, table, _ = batch
    dot = _run(q, cache, qsl, seqs, table, d**-0.5)
    dot_setting(False)
    plain = _run(q, cache, qsl, seqs, table, d**-0.5)
    assert (dot[:70] != plain[:70]).float().mean().item() < 0.002
    assert (dot[:70].float() - plain[:70].float()).abs().max() <= 2.0**-5
    assert torch.equal(dot[70:], plain[70:])
    assert torch.isfinite(dot.float()).all()


@pytest.mark.parametrize(
    "case", ["short-chunk", "window", "softcap", "fp32-cache"], ids=lambda c: c
)
def test_what_the_path_does_not_take_keeps_the_tile_kernel(case, dot_setting):
    """A 15-row chunk, a sliding window, a soft cap, an fp32 cache under bf16 q: the tile
    kernel's outputs to the bit, the switch on or off."""
    dot_setting(True)
    lens = [15] if case == "short-chunk" else [40]
    cache_dtype = torch.float32 if case == "fp32-cache" else torch.bfloat16
    q, cache, qsl, seqs, table, _ = _batch([90], lens, HQ, HKV, D, 4, seed=3, dtype=cache_dtype)
    kw = {"window": 50} if case == "window" else {"softcap": 5.0} if case == "softcap" else {}
    on = _run(q, cache, qsl, seqs, table, SCALE, **kw)
    dot_setting(False)
    off = _run(q, cache, qsl, seqs, table, SCALE, **kw)
    assert torch.equal(on, off)
