"""Eager attention: transformers' ``eager_attention_forward``, one request at a time over the
paged cache (``--attention-backend eager``; ``numerics="transformers"`` picks it).

For each request the step's keys and values are written to the cache, then its whole context
is gathered into the layout transformers' ``DynamicCache`` holds ([1, Hkv, S, D], contiguous),
repeated per query head as ``repeat_kv`` does, and attended with the ops transformers runs, in
the same shapes: ``matmul(q, k^T) * scale``, the soft-cap, the additive mask (the dtype's
minimum where a key is in the future or out of the window), ``softmax`` in fp32 cast back to
the model's dtype (gpt-oss: its attention sinks as one more column, the row's maximum
subtracted, the softmax in the scores' dtype), ``matmul(p, v)``. The rows of a request are
those transformers computes for it run alone, so in bf16 they round where and as
transformers' do: no online softmax, no fp32 scores kept. A Python loop over requests and a gather per request and layer: a
numerics-checking path, not a fast one (the torch backend's native kernels are).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trillm.attention.backend import AttentionMetadata


@dataclass
class _Request:
    rows: slice  # this step's rows of q / out
    slots: torch.Tensor  # [S] int64 cache slot of each context position 0 .. S-1
    query_pos: torch.Tensor  # [L, 1] position of each query row
    key_pos: torch.Tensor  # [1, S]
    # position ranges whose tokens attend to each other both ways (Gemma 3's images)
    spans: list[tuple[int, int]] = field(default_factory=list)
    masks: dict[tuple[int | None, torch.dtype], torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask [L, S] of this request's rows (None: no key masked), built once a
        step per window: the dtype's minimum on a future key or one out of the window."""
        key = (window, dtype)
        if key not in self.masks:
            masked = self.key_pos > self.query_pos
            if self.spans:  # transformers' blockwise overlay, OR'ed with the causal mask
                masked &= ~self._same_span()
            if window is not None:
                masked |= self.key_pos <= self.query_pos - window
            self.masks[key] = None
            if bool(masked.any()):
                mask = torch.zeros(masked.shape, dtype=dtype)
                self.masks[key] = mask.masked_fill_(masked, torch.finfo(dtype).min)
        return self.masks[key]

    def _same_span(self) -> torch.Tensor:  # [L, S] bool: query and key in one span
        ids = torch.full((self.key_pos.shape[1],), -1, dtype=torch.int64)
        for index, (start, end) in enumerate(self.spans):
            ids[start:end] = index
        query_ids = ids[self.query_pos[:, 0]]
        return (query_ids[:, None] == ids[None, :]) & (query_ids >= 0)[:, None]


class EagerAttentionBackend:
    name = "eager"
    supports_window_and_softcap = True
    supports_sinks = True
    supports_bidirectional_spans = True

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._block_size = 0
        self._requests: list[_Request] = []

    def plan(self, meta: AttentionMetadata) -> None:
        self._meta, self._requests = meta, []

    def _plan(self, meta: AttentionMetadata, block_size: int) -> list[_Request]:
        if self._meta is meta and self._block_size == block_size and self._requests:
            return self._requests
        starts = meta.query_start_loc.tolist()
        tables = meta.block_table.to("cpu", torch.int64)
        requests = []
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = starts[i], starts[i + 1]
            pos = torch.arange(seq_len)
            slots = tables[i, pos // block_size] * block_size + pos % block_size
            spans = meta.bidirectional_spans[i] if meta.bidirectional_spans else []
            query_pos = pos[seq_len - (end - start) :, None]
            requests.append(_Request(slice(start, end), slots, query_pos, pos[None], spans))
        self._meta, self._block_size, self._requests = meta, block_size, requests
        return requests

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [Hq]
    ) -> torch.Tensor:  # [T, Hq, D]
        if kv_cache.dtype != q.dtype:
            raise ValueError(
                f"The eager attention backend keeps the KV cache in the model's dtype "
                f"({q.dtype}), not {kv_cache.dtype}."
            )
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_cache.index_copy_(0, meta.slot_mapping, k)
        value_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for req in self._plan(meta, kv_cache.shape[2]):
            out[req.rows] = _attend(
                q[req.rows], key_cache, value_cache, req, scale, window, softcap, sinks
            )
        return out


def _heads_first(cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A request's context [S, Hkv, D] as transformers caches and repeats it: [1, Hq, S, D]."""
    states = cache.index_select(0, slots).transpose(0, 1).unsqueeze(0).contiguous()
    _, num_kv_heads, seq_len, head_dim = states.shape
    rep = num_heads // num_kv_heads
    if rep == 1:
        return states
    expanded = states[:, :, None].expand(1, num_kv_heads, rep, seq_len, head_dim)
    return expanded.reshape(1, num_heads, seq_len, head_dim)


def _attend(
    q: torch.Tensor,  # [L, Hq, D], one request's rows
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    req: _Request,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [L, Hq, D]
    num_rows, num_heads, head_dim = q.shape
    keys = _heads_first(key_cache, req.slots, num_heads)
    values = _heads_first(value_cache, req.slots, num_heads)
    query = q.view(1, num_rows, num_heads, head_dim).transpose(1, 2)  # [1, Hq, L, D]
    weights = torch.matmul(query, keys.transpose(2, 3)) * scale  # [1, Hq, L, S]
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    mask = req.mask(window, weights.dtype)
    if mask is not None:
        weights = weights + mask
    if sinks is None:
        probs = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        probs = _softmax_with_sinks(weights, sinks).to(q.dtype)
    return torch.matmul(probs, values).transpose(1, 2)[0]  # [L, Hq, D]


def _softmax_with_sinks(
    weights: torch.Tensor,  # [1, Hq, L, S] masked scores
    sinks: torch.Tensor,  # [Hq]
) -> torch.Tensor:  # [1, Hq, L, S]
    """transformers' gpt-oss eager attention: the sink logit as a last column, the row's
    maximum subtracted, a softmax in the scores' dtype, the sink's column dropped."""
    sink = sinks.reshape(1, -1, 1, 1).expand(1, -1, weights.shape[2], 1).to(weights.dtype)
    combined = torch.cat([weights, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
