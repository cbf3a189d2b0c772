"""Triton attention backend: reshape_and_cache + one unified paged-attention kernel per layer.

Runs on a CUDA GPU; on CPU only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
``trillm.kernels``' Triton modules are first imported), which tests use.
"""

from __future__ import annotations

import torch

from trillm.attention.backend import AttentionMetadata
from trillm.kernels import paged_attention_triton, reshape_and_cache_triton


class TritonAttentionBackend:
    name = "triton"
    supports_sinks = True

    def __init__(
        self,
        block_n: int | None = None,
        target_block_m: int | None = None,
        num_splits: int | None = None,
    ) -> None:
        self.block_n = block_n  # K/V positions per inner-loop tile; None: by head_dim
        self.target_block_m = target_block_m  # query rows x heads per program; None: by step
        self.num_splits = num_splits  # split-KV parts; None: by step (decode steps only)
        self._meta: AttentionMetadata | None = None
        # block_q -> tile schedule of the planned step; layers with one GQA group share one
        self._schedules: dict[int, paged_attention_triton.TileSchedule] = {}

    def plan(self, meta: AttentionMetadata) -> None:
        """Once per step; the tile schedules are built on the first layer's forward, which
        knows the head counts."""
        self._meta = meta
        self._schedules = {}

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if not q.is_cuda and not paged_attention_triton.runs_interpreted():
            raise RuntimeError(
                "The triton attention backend needs CUDA tensors, or TRITON_INTERPRET=1 set "
                "before trillm.kernels' Triton modules are imported."
            )
        if meta is not self._meta:
            self.plan(meta)
        reshape_and_cache_triton.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        schedule = self._schedule(meta, q.shape[1] // k.shape[1], q.device)
        num_splits = self.num_splits or paged_attention_triton.choose_num_splits(
            schedule.tile_req.numel() * k.shape[1], meta.max_seq_len, meta.decode_only
        )
        return paged_attention_triton.paged_attention(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            scale,
            schedule=schedule,
            block_n=self.block_n,
            num_splits=num_splits,
            max_seq_len=meta.max_seq_len,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )

    def _schedule(
        self, meta: AttentionMetadata, group: int, device: torch.device
    ) -> paged_attention_triton.TileSchedule:
        block_q = paged_attention_triton.choose_block_q(
            group, meta.max_query_len, self.target_block_m
        )
        if block_q not in self._schedules:
            self._schedules[block_q] = paged_attention_triton.plan_tiles(
                meta.query_lens_cpu, block_q, device
            )
        return self._schedules[block_q]
