"""Paged attention over a flattened mixed batch, Triton kernel (one kernel for every mix).

The grid is (query tiles, kv heads). A query tile is up to ``block_q`` consecutive query rows of
one request times the ``group = Hq // Hkv`` query heads that share a kv head, flattened into
``block_m = block_q * group_pad`` rows, so one pass over the request's K/V serves the whole GQA
group. The tile -> (request, first row) map is built on the host from the CPU query lengths
(``plan_tiles``), once per step. K/V are read through the block table one ``block_n`` tile of
positions at a time (any page size), with an fp32 online softmax and a causal mask offset by
the request's context length.

Split-KV (flash-decoding): with ``num_splits > 1`` a third grid dim cuts each row's K/V range
into parts; each part writes an fp32 partial output and log-sum-exp, and a second kernel merges
them. ``choose_num_splits`` turns it on for decode steps too small to fill the GPU.

Per layer, optionally: a sliding ``window`` (a row at position ``p`` sees positions
``> p - window``; the K/V loop starts at the tile's first visible position), a logit
``softcap`` (``softcap * tanh(s / softcap)`` on the scaled scores) and attention ``sinks``
(gpt-oss: a logit per query head in each row's softmax that attends to no value; folded into
the finished online softmax, or with split-KV into the merge, as one more partial whose output
is zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trillm.utils import cdiv

_MIN_DOT = 16  # tl.dot needs every dim >= 16
_FILL_PROGRAMS = 256  # programs that keep a large GPU busy (about 2 per SM)
_MAX_SPLITS = 16
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# NOTE: K/V are gathered through the block table, so each K/V tile carries a [block_n, D] tensor
# of 64-bit addresses in registers; block_n * D_pad <= 4096 keeps it from spilling (ptxas, sm_90:
# D=128 at block_n 64 spills with 4 warps, at 32 needs ~200 registers and no stack).
_KV_TILE_ELEMS = 4096


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    sinks_ptr,
    tile_req_ptr,
    tile_start_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    scale_log2,
    split_size,
    num_heads,
    window,
    softcap,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)  # this program's share of the K/V positions (split-KV)
    req = tl.load(tile_req_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)  # first query row of the tile, within the request
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_start + rows // GROUP_PAD  # [BLOCK_M] query row within the request
    head = kv_head * GROUP + rows % GROUP_PAD  # [BLOCK_M] query head
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position of each row

    # NOTE: m_i starts finite so a row with every key masked (padding rows, or a split past the
    # row's position) gives p = 0 and alpha = 1 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, context_len + tile_start + BLOCK_Q)  # last row's position + 1
    split_begin = split * split_size  # split_size is a multiple of BLOCK_N
    split_end = tl.minimum(kv_end, split_begin + split_size)
    if WINDOWED:
        # the tile's first row sees positions from (its position - window + 1) on
        first_visible = tl.maximum(context_len + tile_start - window + 1, 0)
        split_begin = tl.maximum(split_begin, (first_visible // BLOCK_N) * BLOCK_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(split_begin, split_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_mask = pos < kv_end
        block = tl.load(bt_row + pos // PAGE_SIZE, mask=pos_mask, other=0).to(tl.int64)
        base = block * stride_cb + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
        kv_offs = base[:, None] + dims[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            # s is in log2 units: cap the natural-log score, tanh(x) = 2 * sigmoid(2x) - 1
            capped = s * _LN2 / softcap
            s = softcap * (2.0 * tl.sigmoid(2.0 * capped) - 1.0) * _LOG2E
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if SINKS and NUM_SPLITS == 1:  # (split partials: the merge adds the sink)
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=-1.0e30).to(tl.float32) * _LOG2E
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        # partials: out [T, Hq, NUM_SPLITS, HEAD_DIM_PAD] and lse [T, Hq, NUM_SPLITS], fp32,
        # log2 domain; a split that saw no key gets lse = -inf (weight 0 in the merge)
        row = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_mask)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM_PAD + dims[None, :], out, mask=io_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program per (token, query head): the softmax-weighted sum of the split partials
    (and of the head's sink, a partial with a zero output)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row0 = (token * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row0 + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)  # split 0 always saw a key
    # (One branch defines everything it uses: the compiler scopes a name to its branch.)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        top = tl.maximum(top, sink)
        weight = tl.exp2(lse - top)  # [SPLITS_PAD]
        total = tl.sum(weight, axis=0) + tl.exp2(sink - top)
    else:
        weight = tl.exp2(lse - top)  # [SPLITS_PAD]
        total = tl.sum(weight, axis=0)
    part_mask = (splits[:, None] < NUM_SPLITS) & (dims[None, :] < HEAD_DIM)
    offs = (row0 + splits[:, None]) * HEAD_DIM_PAD + dims[None, :]
    parts = tl.load(part_out_ptr + offs, mask=part_mask, other=0.0)  # [SPLITS_PAD, D_PAD]
    out = tl.sum(parts * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def runs_interpreted() -> bool:
    """Whether the kernels were defined under the Triton interpreter (they then take CPU
    tensors): ``TRITON_INTERPRET=1`` was set when this module was imported."""
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class TileSchedule:
    """Which request and first query row each program's query tile covers."""

    tile_req: torch.Tensor  # [num_tiles] int32, request index
    tile_start: torch.Tensor  # [num_tiles] int32, first query row within the request
    block_q: int  # query rows per tile


def choose_block_q(group: int, max_query_len: int, target_m: int | None = None) -> int:
    """Query rows per tile: a decode-only step takes one row (plus head padding up to the dot
    minimum); a prefill step fills ``target_m`` rows (64 unless told)."""
    group_pad = triton.next_power_of_2(group)
    if target_m is None:
        target_m = _MIN_DOT if max_query_len <= 1 else 64
    return max(1, max(target_m, _MIN_DOT) // group_pad)


def plan_tiles(query_lens_cpu: list[int], block_q: int, device: torch.device) -> TileSchedule:
    """Host-side tile map from the CPU query lengths (no device sync)."""
    lens = torch.tensor(query_lens_cpu, dtype=torch.int64)
    tiles_per_req = (lens + block_q - 1) // block_q  # [num_reqs]
    tile_req = torch.repeat_interleave(torch.arange(len(query_lens_cpu)), tiles_per_req)
    first_tile = torch.cumsum(tiles_per_req, 0) - tiles_per_req  # [num_reqs]
    tile_start = (torch.arange(tile_req.numel()) - first_tile[tile_req]) * block_q
    return TileSchedule(
        tile_req=tile_req.to(device=device, dtype=torch.int32),
        tile_start=tile_start.to(device=device, dtype=torch.int32),
        block_q=block_q,
    )


def choose_num_splits(num_programs: int, max_seq_len: int, decode_only: bool) -> int:
    """Split-KV (flash-decoding) only when a decode step has too few (tile, kv head) programs to
    fill the GPU: at most 16 splits, each of at least 256 positions."""
    if not decode_only or num_programs >= _FILL_PROGRAMS:
        return 1
    return max(1, min(_MAX_SPLITS, cdiv(_FILL_PROGRAMS, num_programs), max_seq_len // 256))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    schedule: TileSchedule | None = None,
    block_n: int | None = None,
    num_splits: int = 1,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [num_tokens, Hq, D]
    """Same contract as ``paged_attention_torch.paged_attention``.

    Without a ``schedule`` one is planned here from ``query_start_loc`` (a device -> host copy).
    ``num_splits > 1`` splits every row's K/V range in that many parts run by separate programs
    and merged after (``max_seq_len``, from the host, sizes the parts; read from ``seq_lens``
    when not given)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}.")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs a unit stride on the last dim of q and the cache.")
    if sinks is not None and (sinks.shape != (num_heads,) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous [{num_heads}] tensor.")
    group = num_heads // num_kv_heads
    if schedule is None:
        query_lens = torch.diff(query_start_loc).tolist()
        block_q = choose_block_q(group, max(query_lens, default=0))
        schedule = plan_tiles(query_lens, block_q, q.device)
    out = torch.empty_like(q)
    num_tiles = schedule.tile_req.numel()
    if num_tokens == 0 or num_tiles == 0:
        return out
    head_dim_pad = max(triton.next_power_of_2(head_dim), _MIN_DOT)
    if block_n is None:
        block_n = min(64, _KV_TILE_ELEMS // head_dim_pad)
    block_n = max(triton.next_power_of_2(block_n), _MIN_DOT)
    group_pad = triton.next_power_of_2(group)
    block_m = schedule.block_q * group_pad
    if num_splits > 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        split_size = cdiv(max_seq_len, num_splits * block_n) * block_n
        part_out = torch.empty(
            num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:
        split_size = 2**31 - block_n  # one split covering every position
        part_out = part_lse = out  # not written
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        block_table,
        query_start_loc,
        seq_lens,
        q if sinks is None else sinks,  # not read without sinks
        schedule.tile_req,
        schedule.tile_start,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        scale * math.log2(math.e),
        split_size,
        num_heads,
        window or 0,
        float(softcap or 1.0),
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=schedule.block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if block_m >= 64 else 4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            q if sinks is None else sinks,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            SINKS=sinks is not None,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
        )
    return out
