"""OLMo 2: the Llama decoder with norms after attention and the MLP (none before), and an
RMSNorm over the whole q and k projections (all heads at once) before RoPE. Under tensor
parallelism each rank holds its heads' part of those norms, and their mean of squares is taken
over the ranks (``ShardedRMSNorm``)."""

from __future__ import annotations

import torch
from torch import nn

from trillm.attention.backend import AttentionBackend, AttentionMetadata
from trillm.config import ModelConfig
from trillm.distributed.parallel_state import TensorParallelGroup
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.decoder import ResidualStreamCausalLM
from trillm.model_executor.models.llama import (
    DecoderStack,
    LlamaAttention,
    LlamaDecoderFlags,
    LlamaMLP,
)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm of a vector whose parts lie on the tensor-parallel ranks: each rank's mean of
    squares, averaged over the ranks. Every rank's part has the same length, and a KV head
    replicated on r ranks is counted r times like every other KV head, so the average is the
    whole vector's mean of squares."""

    def __init__(self, size: int, eps: float, tp: TensorParallelGroup) -> None:
        super().__init__(size, eps)
        self.tp = tp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:  # [T, size] (this rank's part) -> same
        assert residual is None, "ShardedRMSNorm has no fused residual add"
        wide = x.float()
        mean_sq = self.tp.all_reduce(wide.pow(2).mean(-1, keepdim=True)) / self.tp.world_size
        return self.weight * (wide * torch.rsqrt(mean_sq + self.eps)).to(x.dtype)  # [T, size]


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__(cfg, backend, flags)
        if self.tp.world_size == 1:
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        else:
            self.q_norm = ShardedRMSNorm(self.q_size, cfg.rms_norm_eps, self.tp)
            self.k_norm = ShardedRMSNorm(self.kv_size, cfg.rms_norm_eps, self.tp)

    def split_heads(
        self,
        q: torch.Tensor,  # [T, q_size]
        k: torch.Tensor,  # [T, kv_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hkv, D]
        q = self.q_norm(q.contiguous()).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).view(-1, self.num_kv_heads, self.head_dim)
        return q, k


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, backend, flags)
        self.mlp = LlamaMLP(cfg, flags.mlp_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H] residual stream
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        attn = self.self_attn(positions, hidden, rotary, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2Model(DecoderStack):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        layers = (Olmo2DecoderLayer(cfg, backend, flags) for _ in range(cfg.num_hidden_layers))
        self.assemble(cfg, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))


class Olmo2ForCausalLM(ResidualStreamCausalLM):
    MODEL_CLASS = Olmo2Model
