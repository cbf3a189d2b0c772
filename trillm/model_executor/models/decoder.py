"""The forward shared by decoders whose layers carry the residual stream themselves
(Gemma, OLMo 2, GPT-NeoX): each layer maps the stream [T, H] to the next one, unlike the Llama
layer's folded residual adds."""

from __future__ import annotations

import math

import torch
from torch import nn

from trillm.attention.backend import AttentionMetadata
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.llama import LlamaForCausalLM


class ResidualStreamCausalLM(LlamaForCausalLM):
    SCALE_EMBEDDINGS = False  # Gemma: embeddings times sqrt(hidden_size)

    def rotary_for(self, layer: nn.Module) -> RotaryEmbedding:
        """The RoPE table of a layer (Gemma 3: its sliding-window layers have their own)."""
        return self.rotary

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        hidden = self.model.embed_tokens(input_ids)
        if self.SCALE_EMBEDDINGS:  # NOTE: the scale rounded to the run's dtype, as HF does
            hidden = hidden * torch.tensor(math.sqrt(self.config.hidden_size), dtype=hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(positions, hidden, self.rotary_for(layer), kv_cache, meta)
        return self.model.norm(hidden)
