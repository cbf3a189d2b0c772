"""GPT-NeoX (Pythia, ...): LayerNorm with bias, a plain gelu MLP, biases on every projection,
RoPE over the first ``rotary_pct`` of each head, and the parallel residual
``x + attn(ln1(x)) + mlp(ln2(x))`` (sequential when ``use_parallel_residual`` is false).

The module tree uses the Llama names; ``load_weights`` renames the checkpoint's
(``gpt_neox.layers.N.attention.query_key_value``, ...) and reorders the fused q/k/v rows, which
the checkpoint interleaves per head, into trillm's q | k | v stacking.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.backend import AttentionBackend, AttentionMetadata
from trillm.config import ModelConfig
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.decoder import ResidualStreamCausalLM
from trillm.model_executor.models.llama import (
    DecoderStack,
    LlamaAttention,
    LlamaDecoderFlags,
    rank_shapes,
)

# checkpoint name fragment -> trillm's (applied in order, first match per fragment)
_RENAMES = (
    ("gpt_neox.embed_in.", "model.embed_tokens."),
    ("gpt_neox.final_layer_norm.", "model.norm."),
    ("gpt_neox.layers.", "model.layers."),
    (".attention.query_key_value.", ".self_attn.qkv_proj."),
    (".attention.dense.", ".self_attn.o_proj."),
    ("embed_out.", "lm_head."),
)
# Buffers old exports carry (causal mask, rotary tables): not parameters.
_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


class NeoXMLP(nn.Module):
    """Column-parallel in, row-parallel out (this rank's I / TP columns), then the all-reduce."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tp, shapes = rank_shapes(cfg)
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, shapes.inter_size)
        self.dense_4h_to_h = nn.Linear(shapes.inter_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H] via [T, I / TP]
        return self.tp.all_reduce(self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x))))


class NeoXLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        eps = float(cfg.hf_config.get("layer_norm_eps", 1e-5))
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.self_attn = LlamaAttention(cfg, backend, flags)
        self.mlp = NeoXMLP(cfg)
        self.parallel = bool(cfg.hf_config.get("use_parallel_residual", True))

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H] residual stream
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, kv_cache, meta)
        if self.parallel:
            return hidden + attn + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class NeoXModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        layers = (NeoXLayer(cfg, backend, flags) for _ in range(cfg.num_hidden_layers))
        eps = float(cfg.hf_config.get("layer_norm_eps", 1e-5))
        self.assemble(cfg, layers, nn.LayerNorm(cfg.hidden_size, eps=eps))


class GPTNeoXForCausalLM(ResidualStreamCausalLM):
    MODEL_CLASS = NeoXModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(weights))

    def _renamed(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        heads = rank_shapes(self.config)[1].num_heads  # this rank's (all at TP=1)
        head_dim = self.config.head_dim
        for name, tensor in weights:
            if name.endswith(_BUFFERS):
                continue
            for old, new in _RENAMES:
                name = name.replace(old, new, 1)
            if ".self_attn.qkv_proj." in name:
                # rows [Hq, (q|k|v), D] -> [(q|k|v), Hq, D]
                rows = tensor.view(heads, 3, head_dim, *tensor.shape[1:]).transpose(0, 1)
                tensor = rows.reshape(tensor.shape)
            yield name, tensor
