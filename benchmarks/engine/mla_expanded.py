"""MLA expanded to multi-head attention, for ``mla_cache_win.py``: the same weights, but each
token's K / V of every head are computed when it is written and cached in the K/V layout of the
Llama-family models (``KVCacheLayout.key_value``), then attended by the torch backend."""

from __future__ import annotations

import torch
from torch import nn

from trillm.attention.backend import AttentionMetadata
from trillm.attention.kv_layout import KVCacheLayout
from trillm.attention.torch_backend import TorchAttentionBackend
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.deepseek_mla import MLAAttention


class ExpandedMLA(nn.Module):
    """One layer's MLA weights run as MHA: K = [W_UK c, k_pe] (192 wide), V = W_UV c padded
    with zeros to 192 (one head_dim for K and V, as vLLM pads V without MLA)."""

    def __init__(self, mla: MLAAttention, backend: TorchAttentionBackend) -> None:
        super().__init__()
        self.mla, self.backend = mla, backend

    @staticmethod
    def layout(mla: MLAAttention) -> KVCacheLayout:
        return KVCacheLayout.key_value(mla.num_heads, mla.q_dim)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hq, Dn + R]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        mla = self.mla
        heads, nope, rope, v_dim = mla.num_heads, mla.nope_dim, mla.rope_dim, mla.v_dim
        if mla.q_lora:
            q = mla.q_b_proj(mla.q_a_layernorm(mla.q_a_proj(hidden)))
        else:
            q = mla.q_proj(hidden)
        q = q.view(-1, heads, nope + rope)
        latent, k_pe = mla.kv_a_proj_with_mqa(hidden).split([mla.latent_dim, rope], -1)
        latent = mla.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = mla._rope(positions, q[..., nope:], k_pe[:, None], rotary)
        kv = mla.kv_b_proj(latent).view(-1, heads, nope + v_dim)  # [T, Hq, Dn + Dv]
        k = torch.cat([kv[..., :nope], k_pe.expand(-1, heads, rope)], dim=-1)  # [T, Hq, 192]
        v = nn.functional.pad(kv[..., nope:], (0, nope + rope - v_dim))  # [T, Hq, 192]
        q = torch.cat([q[..., :nope], q_pe], dim=-1)
        out = self.backend.forward(q, k, v, kv_cache, meta, mla.scale)[..., :v_dim]
        return mla.o_proj(out.reshape(-1, heads * v_dim))


def expand_mla(model: nn.Module, backend: TorchAttentionBackend) -> None:
    """Every decoder layer's ``self_attn`` (an ``MLAAttention``) becomes its ``ExpandedMLA``."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.self_attn = ExpandedMLA(layer.self_attn, backend)


class LayerCaches:
    """Per layer, each form's paged cache in its layout, ``blocks`` blocks of ``BLOCK_SIZE``
    tokens: zeros, or random values (what attention reads does not change its cost)."""

    BLOCK_SIZE = 16

    def __init__(
        self, mla: nn.Module, expanded: nn.Module, blocks: int, dtype: torch.dtype, zero: bool
    ) -> None:
        from trillm.model_executor.models.deepseek import DeepseekV2ForCausalLM

        def alloc(layout: KVCacheLayout) -> torch.Tensor:
            cache = torch.empty(layout.shape(blocks, self.BLOCK_SIZE), dtype=dtype)
            return cache.zero_() if zero else cache.uniform_(-1.0, 1.0)

        cfg = mla.config  # type: ignore[union-attr]
        latent = DeepseekV2ForCausalLM.kv_cache_layout(cfg, cfg.num_attention_heads)
        layers = [layer.self_attn for layer in expanded.model.layers]  # type: ignore[union-attr]
        self.mla = [alloc(latent) for _ in layers]
        self.expanded = [alloc(ExpandedMLA.layout(a.mla)) for a in layers]

    def mib(self, name: str) -> float:
        caches = getattr(self, name)
        return sum(c.numel() * c.element_size() for c in caches) / 2**20


def step_meta(
    context_lens: list[int], query_lens: list[int], blocks_per_req: int
) -> AttentionMetadata:
    """A step's metadata: request i holds blocks ``[i * blocks_per_req, ...)`` and has
    ``context_lens[i]`` tokens cached before its ``query_lens[i]`` new ones."""
    num = len(context_lens)
    table = torch.arange(num * blocks_per_req, dtype=torch.int32).view(num, blocks_per_req)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    slots = [
        int(table[i, p // LayerCaches.BLOCK_SIZE]) * LayerCaches.BLOCK_SIZE
        + p % LayerCaches.BLOCK_SIZE
        for i, (c, s) in enumerate(zip(context_lens, seq_lens))
        for p in range(c, s)
    ]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        num_reqs=num,
        num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
