"""The paged kernel's long bf16 chunks with context (the later chunks of a long prompt, read
from the block-paged cache in 64-key tiles with the fresh-prompt kernel's arithmetic): on
AVX512-BF16's ``vdpbf16ps`` (ext/cpu_attention_paged_dp.h) and, on CPUs with AVX2 only, on 8-wide
fp32 FMAs (ext/cpu_attention_paged_avx2.h), against transformers' eager attention and against
the tile kernel (``paged_chunk_kernel("tile")``) they replace for them. This host forces each
path in turn (``paged_chunk_kernel(name)``); a path the CPU lacks skips.

Both round where transformers' bf16 eager attention does; they differ only in the fp32 order of
the sums, so a few outputs in ten thousand round the other way. Chunks shorter than 16 rows
(speculative verification), windowed or soft-capped layers, fp32 and fp8 caches keep the tile
kernel bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from paged_batches import HKV, HQ, SCALE, D, hf_eager_attention

from trillm.kernels import paged_attention_cpu

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)


KERNELS = ["bf16-dot", "avx2"]


@pytest.fixture
def chunk_kernel():
    """Yields use(name) -> whether the CPU has that long-chunk kernel (then it runs them);
    restores the setting."""
    ext = paged_attention_cpu.cpu_kernels("attention")
    before = ext.paged_chunk_kernel()

    def use(name: str) -> bool:
        try:
            ext.paged_chunk_kernel(name)
        except RuntimeError:
            return False
        return True

    yield use
    ext.paged_chunk_kernel(before)


def _use_or_skip(use, name):
    if not use(name):
        pytest.skip(f"this CPU has no {name!r} chunk kernel")


def _items_run(kernel):
    return paged_attention_cpu.cpu_kernels("attention").paged_chunk_items_run(kernel)


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


def test_the_default_is_the_best_kernel_the_cpu_has(chunk_kernel):
    """vdpbf16ps where the CPU has AVX512-BF16, else the AVX2 tiles; unknown names refused."""
    from trillm.kernels import linear_cpu

    ext = paged_attention_cpu.cpu_kernels("attention")
    assert ext.paged_chunk_kernel() == ("bf16-dot" if linear_cpu.available_bf16() else "avx2")
    assert chunk_kernel("tile") and ext.paged_chunk_kernel() == "tile"
    assert chunk_kernel("bf16-dot") is linear_cpu.available_bf16()
    with pytest.raises(ValueError, match="one of 'tile', 'avx2', 'bf16-dot', 'bf16-dot-per-item'"):
        ext.paged_chunk_kernel("amx")
    with pytest.raises(ValueError, match="'bf16-dot', 'avx2'"):
        ext.paged_chunk_items_run("tile")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", KERNELS)
def test_long_chunks_equal_transformers_eager(kernel, threads, chunk_kernel, monkeypatch):
    """Chunks of 16 .. 130 rows (the path's shortest, the 32-row blocks of 3 query heads a kv
    head, 64-key tiles, odd key counts) after 0 .. 257 cached positions (blocks of 4: chunk
    starts inside a block and on its edge): transformers' eager attention up to a few outputs in
    ten thousand, each within 2^-6; the tile kernel's outputs likewise. The vdpbf16ps path sums
    in another order than the tile kernel, and differs here; the AVX2 path sums P . V in the
    tile kernel's order and only the scores (rounded to bf16 after) in another, and comes out
    equal here: the count of items each ran says it ran."""
    _use_or_skip(chunk_kernel, kernel)
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
    contexts, lens = [0, 1, 3, 64, 100, 257, 5], [16, 17, 33, 65, 130, 64, 1]
    batch = _batch(contexts, lens, HQ, HKV, D, block_size=4, seed=11)
    q, cache, qsl, seqs, table, per_request = batch
    before = _items_run(kernel)
    fast = _run(q, cache, qsl, seqs, table, SCALE)
    # 6 long requests x 2 kv heads, in blocks of 32 rows: 1 + 1 + 2 + 3 + 5 + 2 per kv head
    assert _items_run(kernel) - before == 28
    chunk_kernel("tile")
    plain = _run(q, cache, qsl, seqs, table, SCALE)
    starts = qsl.tolist()
    for i, (ctx, slots) in enumerate(per_request):
        r = slice(starts[i], starts[i + 1])
        keys, values = cache[0].view(-1, HKV, D)[slots], cache[1].view(-1, HKV, D)[slots]
        hf = hf_eager_attention(q[r], keys, values, ctx)
        for out in (fast[r], plain[r]):
            assert (out != hf).float().mean().item() < 0.001
            assert (out.float() - hf.float()).abs().max() <= 2.0**-6
    assert torch.equal(fast[-1:], plain[-1:])  # the one-row request: the decode kernel in both
    if kernel == "bf16-dot":
        assert not torch.equal(fast, plain)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (4, 4, 128), (6, 2, 48), (3, 1, 256)], ids=str)
def test_the_two_paths_agree_across_head_layouts(hq, hkv, d, kernel, chunk_kernel):
    """Groups of 1 .. 4 query heads (GQA), head sizes 48 .. 256, block size 16, one chunk after
    a long context and one in a mixed step with decode rows: equal but for the fp32 order of
    the sums; the decode rows bit for bit."""
    _use_or_skip(chunk_kernel, kernel)
    batch = _batch([300, 40, 9], [70, 1, 1], hq, hkv, d, block_size=16, seed=7)
    q, cache, qsl, seqs, table, _ = batch
    before = _items_run(kernel)
    fast = _run(q, cache, qsl, seqs, table, d**-0.5)
    assert _items_run(kernel) - before == hkv * -(-70 // (96 // (hq // hkv)))  # the path ran
    chunk_kernel("tile")
    plain = _run(q, cache, qsl, seqs, table, d**-0.5)
    assert (fast[:70] != plain[:70]).float().mean().item() < 0.002
    assert (fast[:70].float() - plain[:70].float()).abs().max() <= 2.0**-5
    assert torch.equal(fast[70:], plain[70:])
    assert torch.isfinite(fast.float()).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "case", ["short-chunk", "window", "softcap", "fp32-cache"], ids=lambda c: c
)
def test_what_the_path_does_not_take_keeps_the_tile_kernel(case, kernel, chunk_kernel):
    """A 15-row chunk, a sliding window, a soft cap, an fp32 cache under bf16 q: the tile
    kernel's outputs to the bit, the path chosen or not."""
    _use_or_skip(chunk_kernel, kernel)
    lens = [15] if case == "short-chunk" else [40]
    cache_dtype = torch.float32 if case == "fp32-cache" else torch.bfloat16
    q, cache, qsl, seqs, table, _ = _batch([90], lens, HQ, HKV, D, 4, seed=3, dtype=cache_dtype)
    kw = {"window": 50} if case == "window" else {"softcap": 5.0} if case == "softcap" else {}
    before = _items_run(kernel)
    on = _run(q, cache, qsl, seqs, table, SCALE, **kw)
    assert _items_run(kernel) == before
    chunk_kernel("tile")
    off = _run(q, cache, qsl, seqs, table, SCALE, **kw)
    assert torch.equal(on, off)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_the_avx2_path_equals_transformers_eager_across_gqa_and_a_holed_table(
    group, d, chunk_kernel
):
    """The AVX2 path (forced here) at GQA ratios 1 / 4 / 8 and head sizes 64 / 128: chunks of 16,
    45 and 97 rows (not multiples of the 16-slot block, of the 96 / group rows of an item or of
    the 64-key tile) after 0, 37 and 200 cached positions, in a block table whose rows hold
    unused entries (-1) past each request's blocks, over a cache whose unused blocks are NaN (a
    wrong block read would show): transformers' eager attention up to a few outputs in a
    thousand, each within 2^-5."""
    _use_or_skip(chunk_kernel, "avx2")
    hkv = 2
    hq = group * hkv
    contexts, lens = [0, 37, 200], [16, 45, 97]
    q, cache, qsl, seqs, table, per_request = _batch(contexts, lens, hq, hkv, d, 16, seed=group)
    used = torch.zeros(cache.shape[1], dtype=torch.bool)
    for _, slots in per_request:
        used[slots // 16] = True
    cache[:, ~used] = float("nan")
    table = torch.cat([table, torch.full((table.shape[0], 3), -1, dtype=torch.int32)], dim=1)
    for i, s in enumerate(seqs.tolist()):
        table[i, -(-s // 16) :] = -1
    before = _items_run("avx2")
    out = _run(q, cache, qsl, seqs, table, d**-0.5)
    block = 96 // group  # rows per item
    assert _items_run("avx2") - before == hkv * sum(-(-n // block) for n in lens)
    starts = qsl.tolist()
    for i, (ctx, slots) in enumerate(per_request):
        r = slice(starts[i], starts[i + 1])
        keys, values = cache[0].view(-1, hkv, d)[slots], cache[1].view(-1, hkv, d)[slots]
        hf = hf_eager_attention(q[r], keys, values, ctx, d**-0.5)
        assert (out[r] != hf).float().mean().item() < 0.002
        assert (out[r].float() - hf.float()).abs().max() <= 2.0**-5
