"""Paged attention over a flattened mixed batch, torch reference: one request at a time.

The contract (``trillm/attention/backend.py``): request ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``, at positions ``context_lens[i] .. seq_lens[i]-1``,
and attends causally (row at position ``p`` sees positions ``<= p``) to the keys/values
already in the paged cache, this step's included.

Optional per layer: a sliding ``window`` (row at ``p`` sees only positions ``> p - window``, as
transformers' sliding-window layers do) and a logit ``softcap`` (``softcap * tanh(s / softcap)``
on the scaled scores before the softmax, Gemma 2); attention ``sinks`` ([Hq], gpt-oss): a
logit per query head that joins each row's softmax and attends to no value.

bf16 queries: transformers' bf16 eager attention, rounding where it rounds: q . k rounded to
bf16, times the scale, rounded again; the softmax in fp32, its probabilities rounded to bf16; the
weighted sum in fp32, rounded once at the end.
"""

from __future__ import annotations

import torch

from trillm.utils import cdiv


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], keys or values
    block_row: torch.Tensor,  # [max_blocks_per_req] int32, one request's block table row
    seq_len: int,
) -> torch.Tensor:  # [seq_len, Hkv, D]
    block_size = cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    blocks = cache[block_row[:num_blocks].long()]  # [num_blocks, block_size, Hkv, D]
    return blocks.flatten(0, 1)[:seq_len]


def _attend_one(
    q,
    k,
    v,
    context_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # q: [Lq, Hq, D]; k, v: [Lk, Hkv, D] with Lk = context_len + Lq -> [Lq, Hq, D]
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [Lk, Hq, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k)  # [Hq, Lq, Lk]
    if q.dtype == torch.bfloat16:
        # transformers' bf16 attention: q . k rounded to bf16, times the scale, rounded again
        scores = (scores.to(q.dtype) * scale).to(q.dtype).float()
    else:
        scores = scores * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = context_len + torch.arange(q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos  # [Lq, Lk]
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float()[:, None, None].expand(*scores.shape[:2], 1)  # [Hq, Lq, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if q.dtype == torch.bfloat16:
        probs = probs.to(q.dtype).float()  # transformers' softmax(..., dtype=fp32).to(bf16)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [num_tokens, Hq, D]
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_i = q[starts[i] : starts[i + 1]]
        k_i = gather_context(kv_cache[0], block_table[i], seq_len)
        v_i = gather_context(kv_cache[1], block_table[i], seq_len)
        context_len = seq_len - q_i.shape[0]
        out[starts[i] : starts[i + 1]] = _attend_one(
            q_i, k_i, v_i, context_len, scale, window, softcap, sinks
        )
    return out
