"""The torch attention backend's gather-path plan: a step's requests in groups (``Group``:
decode rows, or prefill rows padded to the longest chunk), each with its query rows, the cache
slots of its context and its mask (causal, offset by each request's context length; narrowed
to a sliding window by ``windowed_mask``). Built from the step's ``AttentionMetadata`` once per
step and reused by every layer; ``torch_backend`` attends with them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trillm.attention.backend import AttentionMetadata


@dataclass
class Group:
    """Requests attended together: their padded query rows and gathered context slots."""

    query_index: torch.Tensor  # decode: [Rg]; prefill: [Rg, Lq] rows of this step's q
    out_index: torch.Tensor  # prefill: [Tg] row of the flat padded output per token
    token_rows: torch.Tensor  # [Tg] rows of q/out this group owns, in order
    gather_slots: torch.Tensor  # [Rg, S] cache slot of each context position
    mask: torch.Tensor  # [Rg, 1, Lq, S] bool, True = attend
    query_pos: torch.Tensor  # [Rg, Lq] position of each query row (for a sliding window)
    decode: bool
    covers_all: bool = False  # the group is the whole step, rows in order


def _context_slots(
    block_table: torch.Tensor,  # [R, max_blocks] int32
    block_size: int,
    max_len: int,
) -> torch.Tensor:  # [R, max_len] int64
    pos = torch.arange(max_len, device=block_table.device)
    blocks = block_table[:, : (max_len + block_size - 1) // block_size].long()
    return blocks[:, pos // block_size] * block_size + pos % block_size


def decode_group(meta: AttentionMetadata, reqs: torch.Tensor, block_size: int) -> Group:
    seq_lens = meta.seq_lens[reqs].long()  # [Rg]
    if len(reqs) == meta.num_reqs:
        max_len = meta.max_seq_len
    else:
        max_len = max(meta.seq_lens_cpu[i] for i in reqs.tolist())
    pos = torch.arange(max_len, device=seq_lens.device)
    mask = (pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [Rg, 1, 1, S]
    rows = meta.query_start_loc[reqs].long()  # [Rg], one row each
    return Group(
        query_index=rows,
        out_index=torch.arange(len(rows), device=rows.device),
        token_rows=rows,
        gather_slots=_context_slots(meta.block_table[reqs], block_size, max_len),
        mask=mask,
        query_pos=seq_lens[:, None] - 1,
        decode=True,
        covers_all=len(reqs) == meta.num_reqs,
    )


def prefill_group(meta: AttentionMetadata, reqs: torch.Tensor, block_size: int) -> Group:
    device = meta.seq_lens.device
    starts = meta.query_start_loc[reqs].long()  # [Rg]
    query_lens = meta.query_start_loc[reqs + 1].long() - starts
    context_lens = meta.context_lens[reqs].long()
    seq_lens = meta.seq_lens[reqs].long()
    reqs_cpu = reqs.tolist()
    max_q = max(meta.query_lens_cpu[i] for i in reqs_cpu)
    max_len = max(meta.seq_lens_cpu[i] for i in reqs_cpu)
    offsets = torch.arange(max_q, device=device)  # [Lq]
    # Padded query rows point at row 0 of the request; their outputs are dropped.
    valid = offsets[None, :] < query_lens[:, None]  # [Rg, Lq]
    query_index = torch.where(valid, starts[:, None] + offsets[None, :], starts[:, None])
    pos = torch.arange(max_len, device=device)  # [S]
    causal = pos[None, None, :] <= (context_lens[:, None] + offsets[None, :])[:, :, None]
    mask = (causal & (pos[None, None, :] < seq_lens[:, None, None]))[:, None]  # [Rg,1,Lq,S]
    flat = torch.arange(len(reqs_cpu), device=device)[:, None] * max_q + offsets[None, :]
    return Group(
        query_index=query_index,
        out_index=flat[valid],  # [Tg] in token order (requests are in batch order)
        token_rows=query_index[valid],
        gather_slots=_context_slots(meta.block_table[reqs], block_size, max_len),
        mask=mask,
        query_pos=context_lens[:, None] + offsets[None, :],
        decode=False,
    )


def build_groups(
    meta: AttentionMetadata, decode: list[int], prefill: list[int], block_size: int
) -> list[Group]:
    """A decode group of requests ``decode`` and a prefill group of ``prefill`` (each left out
    when it has no request)."""
    device = meta.seq_lens.device
    groups = []
    if decode:
        groups.append(decode_group(meta, torch.tensor(decode, device=device), block_size))
    if prefill:
        groups.append(prefill_group(meta, torch.tensor(prefill, device=device), block_size))
    return groups


def windowed_mask(
    group: Group, window: int | None, chunk: int | None = None
) -> torch.Tensor:  # [Rg, 1, Lq, S] bool
    """The group's mask, narrowed to the last ``window`` positions up to each row's own, or
    (chunked local attention, Llama 4) to the positions of the row's own ``chunk``-sized
    chunk of the sequence: absolute positions, whatever prefill chunks the step holds."""
    if window is None and chunk is None:
        return group.mask
    pos = torch.arange(group.mask.shape[-1], device=group.mask.device)  # [S]
    if chunk is not None:
        first = group.query_pos - group.query_pos % chunk  # [Rg, Lq]: the chunk's first
        inside = pos[None, None, :] >= first[:, :, None]  # [Rg, Lq, S]
    else:
        assert window is not None
        inside = pos[None, None, :] > (group.query_pos - window)[:, :, None]
    return group.mask & inside[:, None]


def with_bidirectional_spans(
    group: Group,
    spans: list[list[tuple[int, int]]],  # per request of the group, position ranges
) -> Group:
    """The prefill group whose rows inside a span also see that span's later keys: the span's
    tokens attend both ways (transformers' blockwise overlay, OR'ed with the causal mask)."""
    device = group.mask.device
    max_len = group.mask.shape[-1]
    key_ids = torch.full((len(spans), max_len), -1, dtype=torch.int64)  # [Rg, S] span index
    for row, ranges in enumerate(spans):
        for index, (start, end) in enumerate(ranges):
            key_ids[row, start:end] = index
    key_ids = key_ids.to(device)
    query_ids = key_ids.gather(1, group.query_pos.clamp(max=max_len - 1))  # [Rg, Lq]
    same = (query_ids[:, :, None] == key_ids[:, None, :]) & (query_ids >= 0)[:, :, None]
    return replace(group, mask=group.mask | same[:, None])
