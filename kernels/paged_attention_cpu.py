"""Paged attention on CPU: the native kernel of ``ext/cpu_attention.cpp``, same contract as
``paged_attention_torch.paged_attention`` (its reference) but reading K/V in place from the
block-paged cache: no gather into dense copies, no padding, no mask tensor.

fp32 and bf16 (math in fp32); the work is spread over ``num_threads()`` threads of the
extension's own pool.
``available()`` is False when the extension is not built or ``TRILLM_NO_EXTENSIONS=1``; callers
then use the torch path.
"""

from __future__ import annotations

import os

import torch

from trillm._native import native_available, native_module

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def num_threads() -> int:
    """``TRILLM_CPU_ATTENTION_THREADS`` if set, else torch's intra-op thread count."""
    value = os.environ.get("TRILLM_CPU_ATTENTION_THREADS", "").strip()
    return max(1, int(value)) if value else torch.get_num_threads()


def available() -> bool:
    return native_available("cpu_attention")


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, fp32/bf16, one dtype, head_dim a multiple
    of 8 up to 512, at most 64 query heads per kv head)."""
    return (
        q.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and q.dtype in _DTYPES
        and kv_cache.dtype == q.dtype
        and q.shape[-1] <= 512
        and q.shape[-1] % 8 == 0
        and q.shape[1] % kv_cache.shape[3] == 0
        and q.shape[1] // kv_cache.shape[3] <= 64
    )


def _check_int32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32 or t.device.type != "cpu" or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a CPU int32 tensor, contiguous in its last dim.")


def paged_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D], rows may be strided (a view of a fused qkv)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, Hq, D]
    reqs: torch.Tensor | None = None,  # [n] int32: attend only these requests' rows
) -> torch.Tensor:  # [num_tokens, Hq, D]
    ext = native_module("cpu_attention")
    if ext is None:
        raise RuntimeError("trillm._ext.cpu_attention is not built.")
    if not supports(q, kv_cache):
        raise ValueError("paged_attention_cpu: unsupported device, dtype or head layout.")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in its last dim.")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous.")
    for name, t in (
        ("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):  # fmt: skip
        _check_int32(name, t)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] < num_reqs:
        raise ValueError("query_start_loc, seq_lens and block_table disagree on num_reqs.")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError("out must match q's shape and dtype, contiguous in its last dim.")
    if reqs is not None:
        _check_int32("reqs", reqs)
    ext.paged_attention(
        out=out.data_ptr(),
        q=q.data_ptr(),
        k_cache=kv_cache[0].data_ptr(),
        v_cache=kv_cache[1].data_ptr(),
        block_table=block_table.data_ptr(),
        query_start_loc=query_start_loc.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        num_reqs=num_reqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        q_token_stride=q.stride(0),
        q_head_stride=q.stride(1),
        out_token_stride=out.stride(0),
        out_head_stride=out.stride(1),
        block_table_stride=block_table.stride(0),
        max_blocks_per_req=block_table.shape[1],
        num_blocks=kv_cache.shape[1],
        scale=float(scale),
        dtype=_DTYPES[q.dtype],
        req_indices=0 if reqs is None else reqs.data_ptr(),
        num_selected=-1 if reqs is None else reqs.shape[0],
        num_threads=num_threads(),
    )
    return out
