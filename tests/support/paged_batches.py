"""Paged attention inputs built by hand: ``attention_metadata`` for given context and query
lengths over block tables, and a random bf16 batch with each request's keys and values, with
transformers' eager attention to compare with."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trillm.attention.backend import AttentionMetadata

BS = 4  # tokens per KV block
HQ, HKV, D = 6, 2, 64
SCALE = D**-0.5


def hf_eager_attention(q, keys, values, context_len, scale=SCALE):
    """transformers' bf16 eager attention of one request: q [Lq, Hq, D], keys/values
    [S, Hkv, D] bf16 -> [Lq, Hq, D] bf16."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    lq, s = q.shape[0], keys.shape[0]
    q_pos = context_len + torch.arange(lq)[:, None]
    mask = torch.zeros(lq, s, dtype=q.dtype)
    mask.masked_fill_(torch.arange(s)[None, :] > q_pos, torch.finfo(q.dtype).min)
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // keys.shape[1], training=False)
    out, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        mask[None, None],
        scale,
    )  # [1, Lq, Hq, D]
    return out[0]


def paged_bf16_batch(context_lens, query_lens, seed=0):
    """A paged bf16 batch: (metadata, cache [2, blocks, BS, Hkv, D], q [T, Hq, D], k, v [T, Hkv,
    D], per request (context length, the keys and values of its positions [S, Hkv, D]))."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-(c + q) // BS) for c, q in zip(context_lens, query_lens)]
    perm = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    tables = [perm[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    meta = attention_metadata(context_lens, query_lens, tables)
    cache = (1.5 * torch.randn(2, sum(blocks) + 2, BS, HKV, D, generator=g)).to(torch.bfloat16)
    t = meta.num_tokens
    q, k, v = ((1.5 * torch.randn(t, h, D, generator=g)).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    # this step's keys/values land in the cache when the backend runs; the references read the
    # cache after that
    per_request = []
    for i, (ctx, table) in enumerate(zip(context_lens, tables)):
        seq = ctx + query_lens[i]
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(seq)])
        per_request.append((ctx, slots))
    return meta, cache, q, k, v, per_request


def sink_problem(
    query_lens, seq_lens, heads, kv_heads, head_dim, block_size, seed, dtype=torch.float32
):
    """A random paged batch for the attention-sink kernels: (q [T, Hq, D], cache [2, blocks,
    block_size, Hkv, D], query start locations, sequence lengths, shuffled block tables, sinks
    [Hq] large enough to take much of the mass)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    perm = torch.randperm(sum(blocks), generator=g, dtype=torch.int32)
    for i, n in enumerate(blocks):
        table[i, :n] = perm[sum(blocks[:i]) : sum(blocks[:i]) + n]
    kv = torch.randn(2, sum(blocks), block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = (2 * torch.randn(sum(query_lens), heads, head_dim, generator=g)).to(dtype)
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    sinks = 2 * torch.randn(heads, generator=g)
    return q, kv, qsl, torch.tensor(seq_lens, dtype=torch.int32), table, sinks


def attention_metadata(context_lens, query_lens, block_tables) -> AttentionMetadata:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    qsl = torch.tensor([0] + query_lens).cumsum(0).int()
    width = max(len(b) for b in block_tables)
    table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
    slots = [
        table[i, p // BS].item() * BS + p % BS
        for i, (c, s) in enumerate(zip(context_lens, seq_lens))
        for p in range(c, s)
    ]
    return AttentionMetadata(
        num_reqs=len(query_lens),
        num_tokens=sum(query_lens),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
