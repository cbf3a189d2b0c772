"""Shared by the decode-attention kernel tests (tests/native/test_cpu_attention_decode_*.py):
pick a decode kernel by name for a block, build one decode row per request over a scattered
paged cache whose unowned slots hold NaN, and run the CPU paged attention over it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

from trillm.kernels import paged_attention_cpu

# (q [rows, heads, head_dim], kv cache [2, blocks, block_size, kv_heads, head_dim],
#  query_start_loc, seq_lens, block_table)
DecodeProblem = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def attention_ext():
    from trillm._ext import cpu_kernels

    return cpu_kernels.attention


@contextlib.contextmanager
def decode_kernel(name: str) -> Iterator[None]:
    """Runs the block on the decode kernel ``name``; skips where this CPU has none such."""
    ext = attention_ext()
    try:
        before = ext.paged_decode_kernel(name)
    except RuntimeError:
        pytest.skip(f"this CPU has no {name!r} decode kernel")
    try:
        yield
    finally:
        ext.paged_decode_kernel(before)


def decode_problem(
    seq_lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    seed: int = 0,
    nan_fill: bool = True,
) -> DecodeProblem:
    """One decode row per request over a shuffled block table; every slot the requests do not
    own (unused blocks, tails past a request's last key) holds NaN (nan_fill; else random
    values): read, they would poison the output."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq_lens), max(blocks_needed) + 2), num_blocks - 1, dtype=torch.int32)
    kv = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    if not nan_fill:
        kv.normal_(generator=g)
    used = 0
    for i, (s, n) in enumerate(zip(seq_lens, blocks_needed)):
        ids = perm[used : used + n]
        used += n
        table[i, :n] = ids
        flat = kv[:, ids].reshape(2, n * block_size, kv_heads, head_dim)
        flat[:, :s] = 1.5 * torch.randn(2, s, kv_heads, head_dim, generator=g)
        kv[:, ids] = flat.view(2, n, block_size, kv_heads, head_dim)
    tokens = len(seq_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q = qkv[:, : heads * head_dim].to(q_dtype).view(tokens, heads, head_dim)
    qsl = torch.arange(tokens + 1, dtype=torch.int32)
    return q, kv.to(cache_dtype), qsl, torch.tensor(seq_lens, dtype=torch.int32), table


def run_decode(problem: DecodeProblem, kernel: str, **kwargs) -> torch.Tensor:
    """The CPU paged attention of ``problem`` on the decode kernel ``kernel``."""
    q, kv, qsl, seq_lens, table = problem
    with decode_kernel(kernel):
        return paged_attention_cpu.paged_attention(
            q, kv, qsl, seq_lens, table, q.shape[-1] ** -0.5, **kwargs
        )


def fp64_reference(problem: DecodeProblem, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """Each row's attention in fp64 over the cache's values as stored (widened exactly); a
    sink is one more logit per head that attends to no value."""
    q, kv, qsl, seq_lens, table = problem
    heads, d = q.shape[1], q.shape[2]
    kv_heads, block_size = kv.shape[3], kv.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, s in enumerate(seq_lens.tolist()):
        lo = max(0, s - window) if window else 0
        pos = torch.arange(lo, s)
        slots = table[r, pos // block_size].long() * block_size + pos % block_size
        k, v = (kv[i].double().reshape(-1, kv_heads, d)[slots] for i in (0, 1))
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[r].double(), k) / math.sqrt(d)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        p = scores.softmax(-1)[:, : len(pos)]
        out[r] = torch.einsum("ht,thd->hd", p, v)
    return out
