"""The forward shared by decoders whose layers carry the residual stream themselves
(Gemma, OLMo 2, GPT-NeoX): each layer maps the stream [T, H] to the next one, unlike the Llama
layer's folded residual adds."""

from __future__ import annotations

import math

import torch
from torch import nn

from trillm.attention.backend import AttentionMetadata
from trillm.distributed.pipeline import IntermediateTensors
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.llama import LlamaForCausalLM


class ResidualStreamCausalLM(LlamaForCausalLM):
    SCALE_EMBEDDINGS = False  # Gemma: embeddings times sqrt(hidden_size)
    PP_CARRIES_RESIDUAL = False  # the hidden states are the residual stream
    # Its embed path (a scaled lookup) does not merge given rows: prompt embeddings refused.
    ACCEPTS_PROMPT_EMBEDS = False

    def rotary_for(self, layer: nn.Module) -> RotaryEmbedding:
        """The RoPE table of a layer (Gemma 3: its sliding-window layers have their own)."""
        return self.rotary

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per stage layer [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # from the stage before (not stage 0)
    ) -> torch.Tensor | IntermediateTensors:  # [T, H]; what the next stage needs if any
        if intermediate is not None:
            hidden = intermediate.hidden
        else:
            hidden = self.embed_input_ids(input_ids)
        for layer, kv_cache in zip(self.stage_layers(), kv_caches):
            hidden = layer(positions, hidden, self.rotary_for(layer), kv_cache, meta)
        if not self.pp.is_last:
            return IntermediateTensors(hidden)
        return self.model.norm(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """The first layer's input (Gemma 3 writes image features over it, unscaled)."""
        hidden = self.model.embed_tokens(input_ids)
        if self.SCALE_EMBEDDINGS:
            hidden = hidden * self._embedding_scale(hidden.dtype)
        return hidden

    def _embedding_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """``sqrt(hidden_size)`` rounded to the run's dtype, as HF does; made once (a tensor
        made from a Python number inside the forward would stop step-program replay)."""
        scales: dict[torch.dtype, torch.Tensor] = self.__dict__.setdefault("_embedding_scales", {})
        if dtype not in scales:
            scales[dtype] = torch.tensor(math.sqrt(self.config.hidden_size), dtype=dtype)
        return scales[dtype]
