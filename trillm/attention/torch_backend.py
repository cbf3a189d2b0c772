"""Paged attention with torch ops, and on CPU the native paged kernel. No Python loop over
requests.

On CPU with the native extension built (``ext/cpu_attention.cpp``, fp32/bf16), every request
that has context in the cache (decode rows, later prefill chunks, prefix-cache hits) attends
with that kernel, which reads K/V in place from the blocks: no gather, no padding, no mask.
Fresh prompts take the native causal kernel of ``ext/cpu_prefill_attention.cpp`` there (fp32
and bf16; both native kernels round bf16 where transformers' bf16 eager attention does, so a
bf16 layout the prefill kernel lacks goes to the paged one), else the ``is_causal`` fast path
below. Elsewhere (CUDA, fp16,
``TRILLM_NO_EXTENSIONS=1``) it is one scatter to write K/V, one gather per request group, one
``scaled_dot_product_attention`` per group:

A step's requests fall in at most two groups (``torch_groups``), planned once per step
(``plan``) and reused by every layer: decode rows (query length 1, the fast path: no query
padding, a padding-only mask) and prefill rows (queries padded to the longest chunk, causal
mask offset by each request's context length). Splitting them keeps one long prefill from
padding every decode row to its length.

Fast path: a prefill chunk with no context before it (a fresh prompt, the common case) attends
causally over its own rows with ``is_causal`` (no gather, no mask, no padding to the longest
chunk; on CPU a 10-prompt mixed-length prefill step of the benchmark model takes 24% less time).

Layers with a sliding ``window`` or a logit ``softcap`` (Gemma 2/3, Mistral, Phi-3) attend
every request, fresh prompts included, with one plan built on the first such layer of a step:
on CPU the native paged kernel (it reads only the window's keys; the fresh-prompt kernel and
the ``is_causal`` fast path have no window), elsewhere the gather path with a decode group and
one prefill group, the window narrowing the mask and a softcap computing the softmax in plain
torch ops (SDPA has no softcap). Layers with attention ``sinks`` (gpt-oss) take the same
route: the native paged kernel in fp32 (it folds each head's sink into its finished online
softmax), else (bf16) the gather path with the sinks as one more softmax column. So does every
layer of a step with image tokens of a model whose images attend both ways inside
(``bidirectional_spans``, Gemma 3): the spans are OR'ed into the prefill group's causal mask
before the window narrows it, as transformers composes them. Llama 4's chunked local attention
(``chunk``: a row sees the keys of its own ``chunk``-sized piece of the sequence, by absolute
position) always takes the gather path, its mask narrowed like a window's.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from trillm.attention.backend import AttentionMetadata
from trillm.attention.torch_groups import (
    Group,
    build_groups,
    decode_group,
    windowed_mask,
    with_bidirectional_spans,
)
from trillm.kernels import paged_attention_cpu, reshape_and_cache_cpu

# fp8 KV caches (--kv-cache-dtype fp8): e4m3 values of x / scale with the scale 1.0, as vLLM
# stores them when no scales are calculated or loaded; beyond +-448 they saturate.
FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)


def _take(
    source: torch.Tensor,  # [N, H, D]
    index: torch.Tensor,  # [R, L] int64
    dtype: torch.dtype | None = None,  # the rows' dtype out (None: source's)
) -> torch.Tensor:  # [R, L, H, D]
    if source.dtype == FP8_KV:  # index_select by bytes, then widen
        rows = source.view(torch.uint8).index_select(0, index.reshape(-1)).view(FP8_KV)
    else:
        rows = source.index_select(0, index.reshape(-1))
    rows = rows if dtype is None else rows.to(dtype)
    return rows.view(*index.shape, *source.shape[1:])


def _explicit_attention(
    queries: torch.Tensor,  # [Rg, Hq, Lq, D]
    keys: torch.Tensor,  # [Rg, Hkv, S, D]
    values: torch.Tensor,  # [Rg, Hkv, S, D]
    mask: torch.Tensor,  # [Rg, 1, Lq, S] bool
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [Hq]
) -> torch.Tensor:  # [Rg, Hq, Lq, D]
    """SDPA's math, fp32 inside, with what SDPA lacks: ``softcap * tanh(s / softcap)`` on the
    scaled scores, and a sink logit per head as one more softmax column that has no value (it
    only takes its share of the probability mass, as transformers' gpt-oss attention does)."""
    group = queries.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # [Rg, Hq, S, D]
    values = values.float().repeat_interleave(group, dim=1)
    scores = queries.float() @ keys.transpose(-1, -2) * scale  # [Rg, Hq, Lq, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)  # [Rg, Hq, Lq, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ values).to(queries.dtype)


class TorchAttentionBackend:
    name = "torch"
    supports_sinks = True  # the native paged kernel (fp32) or the gather path
    supports_bidirectional_spans = True  # the same

    def __init__(self, native: bool | None = None) -> None:
        """``native``: use the native CPU kernel where it applies (None: when it is built)."""
        self._planned: AttentionMetadata | None = None
        self._cache_shape: tuple[int, ...] = ()  # the plan's cache layout
        self._groups: list[Group] = []
        self._fresh: list[tuple[int, int]] = []  # row ranges of prefill chunks without context
        # The same as [n, 2] int32 (first row, length) for the native kernel, when it is used.
        self._fresh_segments: torch.Tensor | None = None
        # This step's native kernel plan (requests with context), None when not used.
        self._native: paged_attention_cpu.PagedAttentionPlan | None = None
        self._native_available = paged_attention_cpu.available() if native is None else native
        # Every request by the gather path, for windowed / softcapped layers (built lazily),
        # or by the native kernel.
        self._all_groups: list[Group] | None = None
        self._native_all: paged_attention_cpu.PagedAttentionPlan | None = None

    @property
    def native_available(self) -> bool:
        """Whether the native CPU kernel serves this backend's steps (where it applies)."""
        return self._native_available

    def plan(self, meta: AttentionMetadata) -> None:
        """Forget the last step's indices; the first layer builds this step's (it knows the
        cache's block size)."""
        self._planned = meta
        self._groups = []
        self._fresh = []
        self._fresh_segments = None
        self._native = None
        self._all_groups = None
        self._native_all = None

    def _plan_step(
        self, meta: AttentionMetadata, q: torch.Tensor, kv_cache: torch.Tensor, native: bool
    ) -> None:
        """This step's fresh-prompt row ranges, and the native kernel's plan or the torch
        path's groups (built by the first layer, reused by the others)."""
        self._fresh, self._groups, self._native = [], [], None
        self._fresh_segments = None
        self._all_groups = None
        self._native_all = None
        block_size = kv_cache.shape[2]

        def native_plan(reqs: torch.Tensor | None) -> paged_attention_cpu.PagedAttentionPlan:
            return paged_attention_cpu.PagedAttentionPlan(
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_table,
                q.shape,
                kv_cache.shape,
                reqs,
            )

        if meta.decode_only:
            if native:
                self._native = native_plan(None)
            else:
                reqs = torch.arange(meta.num_reqs, device=meta.seq_lens.device)
                self._groups = [decode_group(meta, reqs, block_size)]
            return
        # NOTE: a chunk whose query is its whole sequence has no context: a fresh prompt.
        # A bf16 one goes to a native kernel, which rounds where transformers' bf16 attention
        # does (SDPA does not): the prefill kernel, else the paged one with the rest.
        lens = list(zip(meta.query_lens_cpu, meta.seq_lens_cpu))
        paged_only = (
            native
            and q.dtype == torch.bfloat16
            and not paged_attention_cpu.prefill_supports_layout(
                q.dtype, q.shape[1], kv_cache.shape[3], q.shape[2]
            )
        )
        fresh = [] if paged_only else [i for i, (q, s) in enumerate(lens) if q == s > 1]
        if fresh:
            starts = [0, *itertools.accumulate(meta.query_lens_cpu)]  # host copy: no device sync
            self._fresh = [(starts[i], starts[i + 1]) for i in fresh]
            if native and q.device.type == "cpu":
                self._fresh_segments = torch.tensor(
                    [(a, b - a) for a, b in self._fresh], dtype=torch.int32
                )
        if native:
            rest = [i for i, (q, s) in enumerate(lens) if paged_only or not q == s > 1]
            if len(rest) == meta.num_reqs:  # every request (a step program's plan too)
                self._native = native_plan(None)
            elif rest:
                self._native = native_plan(torch.tensor(rest, dtype=torch.int32))
            return
        decode = [i for i, (q, s) in enumerate(lens) if q == 1]
        prefill = [i for i, (q, s) in enumerate(lens) if 1 < q < s]
        self._groups = build_groups(meta, decode, prefill, block_size)

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
        chunk: int | None = None,  # chunked local attention: a row sees only its chunk
    ) -> torch.Tensor:  # [T, Hq, D]
        planned = self._groups or self._fresh or self._native is not None
        if meta is not self._planned or kv_cache.shape != self._cache_shape or not planned:
            self._planned, self._cache_shape = meta, tuple(kv_cache.shape)
            native = self._native_available and paged_attention_cpu.supports(q, kv_cache)
            self._plan_step(meta, q, kv_cache, native)
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        self._write_cache(k, v, kv_cache, key_cache, value_cache, meta.slot_mapping)
        spans = meta.bidirectional_spans
        if window is not None or softcap is not None or sinks is not None or spans or chunk:
            return self._forward_masked(
                q, key_cache, value_cache, kv_cache, meta, scale, window, softcap, sinks, chunk
            )
        if len(self._groups) == 1 and self._groups[0].covers_all:
            return self._attend(self._groups[0], q, key_cache, value_cache, scale)
        out = torch.empty_like(q)
        if self._native is not None:
            self._native.run(q, kv_cache, scale, out)
        segments = self._fresh_segments
        if segments is not None and paged_attention_cpu.prefill_supports(q, k, v):
            paged_attention_cpu.causal_prefill(q, k, v, segments, scale, out)
        else:
            for start, end in self._fresh:
                out[start:end] = self._attend_fresh(q[start:end], k[start:end], v[start:end], scale)
        for group in self._groups:
            out.index_copy_(
                0, group.token_rows, self._attend(group, q, key_cache, value_cache, scale)
            )
        return out

    def _forward_masked(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [num_slots, Hkv, D]
        value_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        chunk: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Every request at once, with the window, the softcap and the sinks: the native
        kernel where it applies (sinks: fp32 only), else the gather path with the window in the
        mask. Chunked local attention always takes the gather path (no native kernel has it)."""
        native = chunk is None and not meta.bidirectional_spans  # (no native kernel has either)
        native = native and (sinks is None or paged_attention_cpu.supports_sinks(q, sinks))
        if native and self._native_available and paged_attention_cpu.supports(q, kv_cache):
            if self._native_all is None:
                self._native_all = paged_attention_cpu.PagedAttentionPlan(
                    meta.query_start_loc, meta.seq_lens, meta.block_table, q.shape, kv_cache.shape
                )
            return self._native_all.run(q, kv_cache, scale, None, window, softcap, sinks)
        if self._all_groups is None:
            decode = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
            prefill = [i for i, n in enumerate(meta.query_lens_cpu) if n > 1]
            self._all_groups = build_groups(meta, decode, prefill, kv_cache.shape[2])
            if meta.bidirectional_spans and prefill:  # (a decode row sees its whole past)
                spans = [meta.bidirectional_spans[i] for i in prefill]
                self._all_groups[-1] = with_bidirectional_spans(self._all_groups[-1], spans)
        out = torch.empty_like(q)
        for group in self._all_groups:
            rows = self._attend(
                group, q, key_cache, value_cache, scale, window, softcap, sinks, chunk
            )
            out.index_copy_(0, group.token_rows, rows)
        return out

    def _write_cache(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        key_cache: torch.Tensor,  # [num_slots, Hkv, D] views of kv_cache
        value_cache: torch.Tensor,
        slots: torch.Tensor,  # [T] int64
    ) -> None:
        if self._native_available and reshape_and_cache_cpu.supports(k, v, kv_cache):
            reshape_and_cache_cpu.reshape_and_cache(k, v, kv_cache, slots)
            return
        if kv_cache.dtype == FP8_KV:  # stored as x / scale, scale 1.0; index_copy_ as bytes
            key_cache.view(torch.uint8).index_copy_(0, slots, to_fp8(k).view(torch.uint8))
            value_cache.view(torch.uint8).index_copy_(0, slots, to_fp8(v).view(torch.uint8))
            return
        key_cache.index_copy_(0, slots, k.to(key_cache.dtype))
        value_cache.index_copy_(0, slots, v.to(value_cache.dtype))

    @staticmethod
    def _attend_fresh(
        q: torch.Tensor,  # [L, Hq, D]
        k: torch.Tensor,  # [L, Hkv, D]
        v: torch.Tensor,  # [L, Hkv, D]
        scale: float,
    ) -> torch.Tensor:  # [L, Hq, D]
        # NOTE: 4-D inputs: with 3-D ones torch's CPU SDPA takes the (3x slower) math path.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, L, D]
        return out[0].transpose(0, 1)

    @staticmethod
    def _attend(
        group: Group,
        q: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [num_slots, Hkv, D]
        value_cache: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:  # [Tg, Hq, D]
        # NOTE: index_select, not advanced indexing: on CPU it is ~100x faster here.
        keys = _take(key_cache, group.gather_slots, q.dtype).transpose(1, 2)  # [Rg, Hkv, S, D]
        values = _take(value_cache, group.gather_slots, q.dtype).transpose(1, 2)
        if group.decode:
            queries = q.index_select(0, group.query_index).unsqueeze(2)  # [Rg, Hq, 1, D]
        else:
            queries = _take(q, group.query_index).transpose(1, 2)  # [Rg, Hq, Lq, D]
        mask = windowed_mask(group, window, chunk)
        if softcap is not None or sinks is not None:
            out = _explicit_attention(queries, keys, values, mask, scale, softcap, sinks)
        else:
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )  # [Rg, Hq, Lq, D]
        if group.decode:
            return out.squeeze(2)
        num_heads, head_dim = out.shape[1], out.shape[3]
        flat = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [Rg * Lq, Hq, D]
        return flat.index_select(0, group.out_index)
