"""Bamba (transformers' ``BambaForCausalLM``): Mamba-2 layers (``mamba2.py``) with attention
at ``attn_layer_indices``, each layer followed by a SwiGLU MLP, pre-norm residuals as Llama's.

The attention layers are Llama's (RoPE over half of each head, as transformers hard-codes) and
alone hold the paged KV cache, in their order; the Mamba-2 layers hold a per-request state
instead (``ssm_state_layout``, ``trillm/attention/ssm_state.py``). Tensor parallelism splits
the Mamba-2 layers by heads (``mamba2.py``); under pipeline parallelism each stage holds its own
layers' states.
"""

from __future__ import annotations

import torch
from torch import nn

from trillm.attention.backend import AttentionBackend, AttentionMetadata
from trillm.attention.ssm_state import SSMStateLayout
from trillm.config import ModelConfig
from trillm.distributed.pipeline import IntermediateTensors
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.layers.vocab_parallel import VocabParallelEmbedding
from trillm.model_executor.models.llama import (
    DecoderStack,
    LlamaAttention,
    LlamaDecoderFlags,
    LlamaForCausalLM,
    LlamaMLP,
)
from trillm.model_executor.models.mamba2 import Mamba2Mixer, hybrid_state_layout, mixer_rows


class BambaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        flags: LlamaDecoderFlags,
        mixer_index: int | None,  # its row among the Mamba-2 layers; None: an attention layer
    ) -> None:
        super().__init__()
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: LlamaAttention | None = None
        if mixer_index is None:
            self.self_attn = LlamaAttention(cfg, backend, flags)
        else:
            self.mamba = Mamba2Mixer(cfg, mixer_index)
        self.feed_forward = LlamaMLP(cfg, flags.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: the previous layer's MLP output (the embeddings first)
        residual: torch.Tensor | None,  # [T, H]: the residual stream so far (None: first layer)
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor | None,  # an attention layer's paged cache
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), both [T, H]
        """transformers' ``residual + mixer(norm(residual))``, then the MLP's, with each add
        folded into the next norm as ``FoldedResidualLayer`` does."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        if self.mamba is not None:
            assert meta.ssm is not None, "a Mamba-2 layer runs with the step's state view"
            hidden = self.mamba(hidden, meta.ssm)
        else:
            assert self.self_attn is not None and kv_cache is not None
            hidden = self.self_attn(positions, hidden, rotary, kv_cache, meta)
        hidden = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class BambaModel(DecoderStack):  # its final norm is ``final_layernorm``
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg, cfg.hidden_size)
        rows = mixer_rows(cfg.hf_config["layer_types"])
        self.layers = nn.ModuleList(BambaDecoderLayer(cfg, backend, flags, row) for row in rows)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BambaForCausalLM(LlamaForCausalLM):
    MODEL_CLASS = BambaModel
    model: BambaModel

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # the stage's attention layers' caches, in layer order
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # from the stage before (not stage 0)
    ) -> torch.Tensor | IntermediateTensors:  # [T, H]; what the next stage needs if any
        if intermediate is None:
            hidden, residual = self.embed_input_ids(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        caches = iter(kv_caches)
        for layer in self.stage_layers():
            kv_cache = next(caches) if layer.self_attn is not None else None
            hidden, residual = layer(positions, hidden, residual, self.rotary, kv_cache, meta)
        if not self.pp.is_last:
            return IntermediateTensors(hidden, residual)
        return self.model.final_layernorm(hidden, residual)

    @classmethod
    def ssm_state_layout(cls, cfg: ModelConfig, tp_size: int = 1) -> SSMStateLayout:
        return hybrid_state_layout(cfg, tp_size)
