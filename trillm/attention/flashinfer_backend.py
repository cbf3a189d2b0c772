"""FlashInfer attention backend (CUDA only): one BatchPrefillWithPagedKVCacheWrapper serves
every batch mix (decode rows are query chunks of length 1).

Per step, the first layer's ``forward`` plans the wrapper (it needs the head counts, dtype and
scale, which ``plan(meta)`` does not carry); every layer then writes its K/V with the Triton
``reshape_and_cache`` and calls ``run``. FlashInfer's causal mask aligns a request's query rows
with the *last* ``qo_len`` of its ``kv_len`` keys, which is our contract: row ``j`` of request
``i`` sits at position ``context_lens[i] + j``. Layout NHD matches
``kv_cache[2, num_blocks, block_size, Hkv, D]`` with (k_cache, v_cache) = (kv_cache[0],
kv_cache[1]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trillm.attention.backend import AttentionMetadata, UnsupportedAttentionFeatureError
from trillm.kernels import reshape_and_cache_triton

_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class _PlanKey:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float


def paged_kv_layout(
    meta: AttentionMetadata, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table from our block table.

    -> (paged_kv_indptr [num_reqs + 1] int32 on CPU, paged_kv_indices [total_pages] int32 on
    the block table's device, paged_kv_last_page_len [num_reqs] int32 on CPU)."""
    seq_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int32)
    pages = (seq_lens + page_size - 1) // page_size  # [num_reqs]
    indptr = torch.zeros(meta.num_reqs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    last_page_len = seq_lens - (pages - 1) * page_size
    table = meta.block_table[:, : int(pages.max().item()) if meta.num_reqs else 0]
    used = torch.arange(table.shape[1]) < pages[:, None]  # [num_reqs, max_pages] on CPU
    indices = table[used.to(table.device)]  # row-major: request by request, page by page
    return indptr, indices.to(torch.int32), last_page_len


class FlashInferAttentionBackend:
    name = "flashinfer"
    supports_window_and_softcap = False

    def __init__(self) -> None:
        import flashinfer  # optional dependency: imported only when this backend is chosen

        self._flashinfer = flashinfer
        # flashinfer's BatchPrefillWithPagedKVCacheWrapper, made by the first forward (q's device)
        self._wrapper: Any = None
        self._meta: AttentionMetadata | None = None
        self._planned: _PlanKey | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        """Once per step; the wrapper itself is planned by the step's first forward."""
        self._meta = meta
        self._planned = None

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
        sinks: torch.Tensor | None = None,  # refused when the model is built (no supports_sinks)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if window is not None or softcap is not None or sinks is not None:
            raise UnsupportedAttentionFeatureError(
                "The flashinfer attention backend does not implement sliding-window attention, "
                "attention logit soft-capping or attention sinks; use --attention-backend "
                "triton or torch."
            )
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"The flashinfer attention backend needs fp16 or bf16, not {q.dtype}.")
        if meta is not self._meta:
            self.plan(meta)
        reshape_and_cache_triton.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        key = _PlanKey(
            q.shape[1], k.shape[1], q.shape[2], kv_cache.shape[2], q.dtype, kv_cache.dtype, scale
        )
        if key != self._planned:
            self._plan_wrapper(meta, key, q.device)
        # q may be a strided view of a fused qkv projection; the cache halves are contiguous
        return self._wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[1]))

    def _plan_wrapper(self, meta: AttentionMetadata, key: _PlanKey, device: torch.device) -> None:
        if self._wrapper is None:
            workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        indptr, indices, last_page_len = paged_kv_layout(meta, key.page_size)
        qo_indptr = torch.zeros(meta.num_reqs + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(meta.query_lens_cpu), 0)
        # NOTE: indptrs and last-page lengths stay on the host (plan reads them there without a
        # device sync); the page indices are read by the kernels, on the device.
        self._wrapper.plan(
            qo_indptr,
            indptr,
            indices.to(device),
            last_page_len,
            key.num_heads,
            key.num_kv_heads,
            key.head_dim,
            key.page_size,
            causal=True,
            sm_scale=key.scale,
            q_data_type=key.q_dtype,
            kv_data_type=key.kv_dtype,
        )
        self._planned = key
