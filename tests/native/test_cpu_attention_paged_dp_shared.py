"""The vdpbf16ps long-chunk path (ext/cpu_attention_paged_dp.h) packs each kv head's key and
value tiles once per call (PdpShared) instead of once per work item: the same tiles, the same
products, so the outputs must be the per-item packing's to the bit (``paged_chunk_kernel(
"bf16-dot-per-item")``, the path as it was). Across GQA ratios 1 / 4 / 8, head sizes 64 / 128,
blocks of 16 / 32 slots, 1 - 3 threads, ragged chunks (not multiples of a block, of an item's
rows or of the 64-key tile) beside decode rows, a cache whose unused blocks are NaN (a wrong
block read shows); a bounded scratch (``paged_chunk_pack_bytes``) split into several batches or
too small for a kv head (packed per item there); windowed and soft-capped layers (not on the
path: equal too). A CPU without AVX512-BF16 skips."""

from __future__ import annotations

import pytest
import torch

from trillm.kernels import paged_attention_cpu

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)


@pytest.fixture
def ext():
    """The attention module with "bf16-dot" chosen (skips where the CPU lacks it); restores the
    chunk kernel and the pack bound."""
    mod = paged_attention_cpu.cpu_kernels("attention")
    before, pack = mod.paged_chunk_kernel(), mod.paged_chunk_pack_bytes()
    try:
        mod.paged_chunk_kernel("bf16-dot")
    except RuntimeError:
        pytest.skip("this CPU has no 'bf16-dot' chunk kernel")
    yield mod
    mod.paged_chunk_kernel(before)
    mod.paged_chunk_pack_bytes(pack)


def _batch(contexts, lens, hq, hkv, d, block_size, seed):
    """A random paged batch over scattered blocks, every position cached, the unused blocks
    NaN and the slots past each request's last position in its last block NaN too."""
    g = torch.Generator().manual_seed(seed)
    seqs = [c + n for c, n in zip(contexts, lens)]
    blocks = [-(-s // block_size) for s in seqs]
    total = sum(blocks) + 3
    perm = torch.randperm(total, generator=g)[: sum(blocks)].tolist()
    table = torch.full((len(seqs), max(blocks) + 2), -1, dtype=torch.int32)
    cache = torch.full((2, total, block_size, hkv, d), float("nan"), dtype=torch.bfloat16)
    at = 0
    for i, n in enumerate(blocks):
        row = perm[at : at + n]
        at += n
        table[i, :n] = torch.tensor(row, dtype=torch.int32)
        for p in range(seqs[i]):
            kv = 1.5 * torch.randn(2, hkv, d, generator=g)
            cache[:, row[p // block_size], p % block_size] = kv.to(torch.bfloat16)
    q = (1.5 * torch.randn(sum(lens), hq, d, generator=g)).to(torch.bfloat16)
    qsl = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return q, cache, qsl, torch.tensor(seqs, dtype=torch.int32), table


def _run(q, cache, qsl, seqs, table, **kw):
    plan = paged_attention_cpu.PagedAttentionPlan(qsl, seqs, table, q.shape, cache.shape)
    return plan.run(q, cache, q.shape[2] ** -0.5, None, **kw)


def _both(ext, batch, **kw):
    """(shared packing, per-item packing) outputs; asserts the shared path ran its items."""
    before = ext.paged_chunk_items_run("bf16-dot")
    shared = _run(*batch, **kw)
    ran = ext.paged_chunk_items_run("bf16-dot") - before
    ext.paged_chunk_kernel("bf16-dot-per-item")
    per_item = _run(*batch, **kw)
    ext.paged_chunk_kernel("bf16-dot")
    return shared, per_item, ran


CONTEXTS, LENS = [0, 37, 200, 3, 500], [16, 45, 97, 1, 130]  # a decode row among them


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_shared_tiles_give_the_per_item_bits(group, d, block_size, ext, monkeypatch):
    hkv = 2
    batch = _batch(CONTEXTS, LENS, group * hkv, hkv, d, block_size, seed=group * d + block_size)
    rows = 96 // group  # query rows per item
    items = hkv * sum(-(-n // rows) for n in LENS if n >= 16)
    for threads in (1, 2, 3):
        monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
        shared, per_item, ran = _both(ext, batch)
        assert ran == items
        assert torch.isfinite(shared.float()).all()
        assert torch.equal(shared, per_item), f"{threads} threads"


@pytest.mark.parametrize("pack_bytes", [0, 100_000, 300_000, 1 << 20])
def test_a_bounded_scratch_gives_the_same_bits(pack_bytes, ext, monkeypatch):
    """At head size 64 a kv head of 297 keys packs 5 tiles (80 KiB), of 630 keys 10 (160 KiB):
    a bound of 0 packs every item's tiles itself, 100 kB packs the smaller kv heads one batch
    each and the larger per item, 300 kB a few per batch; all the same bits."""
    monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", "2")
    ext.paged_chunk_pack_bytes(pack_bytes)
    batch = _batch(CONTEXTS, LENS, 8, 2, 64, 16, seed=5)
    shared, per_item, ran = _both(ext, batch)
    assert ran == 2 * (1 + 2 + 5 + 6)
    assert torch.equal(shared, per_item)


def test_the_pack_bound_is_read_back(ext):
    assert ext.paged_chunk_pack_bytes(12345) == 64 << 20
    assert ext.paged_chunk_pack_bytes() == 12345


@pytest.mark.parametrize("kw", [{"window": 50}, {"softcap": 5.0}], ids=["window", "softcap"])
def test_windowed_or_capped_layers_are_unchanged(kw, ext):
    batch = _batch(CONTEXTS, LENS, 8, 2, 64, 16, seed=9)
    shared, per_item, ran = _both(ext, batch, **kw)
    assert ran == 0
    assert torch.equal(shared, per_item)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fresh_prompts_share_their_tiles_with_the_same_bits(group, d, monkeypatch):
    """The fresh-prompt kernel's vdpbf16ps items (ext/cpu_prefill_attention_dp.h) likewise:
    each (segment, kv head)'s tiles packed once per call (``prefill_shared_pack``) against
    every item packing its own, ragged segments of 1 .. 300 rows beside each other."""
    mod = paged_attention_cpu.cpu_kernels("attention")
    before = mod.prefill_bf16_dot(True)
    if not mod.prefill_bf16_dot(True):
        mod.prefill_bf16_dot(before)
        pytest.skip("this CPU has no vdpbf16ps")
    hkv = 2
    g = torch.Generator().manual_seed(group * d)
    lens = [1, 17, 300, 64, 97]
    total = sum(lens)
    q, k, v = (
        (1.5 * torch.randn(total, h, d, generator=g)).to(torch.bfloat16)
        for h in (group * hkv, hkv, hkv)
    )
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    segments = torch.stack([starts, torch.tensor(lens)], dim=1).to(torch.int32).contiguous()
    try:
        for threads in (1, 2, 3):
            monkeypatch.setenv("TRILLM_CPU_ATTENTION_THREADS", str(threads))
            outs = []
            for shared in (True, False):
                mod.prefill_shared_pack(shared)
                out = torch.full_like(q, float("nan"))
                outs.append(paged_attention_cpu.causal_prefill(q, k, v, segments, d**-0.5, out))
            assert torch.isfinite(outs[0].float()).all()
            assert torch.equal(outs[0], outs[1]), f"{threads} threads"
    finally:
        mod.prefill_shared_pack(True)
        mod.prefill_bf16_dot(before)
