"""Gemma 1, 2 and 3 (text): the Llama decoder with Gemma's differences.

All three: RMSNorm scaled by ``1 + weight`` (fp32), a gelu-tanh gated MLP, embeddings scaled by
``sqrt(hidden_size)``, tied head. Gemma 2 adds a norm after attention and after the MLP, the
attention scale ``query_pre_attn_scalar ** -0.5``, attention and final logit soft-capping and
sliding-window attention on alternating layers. Gemma 3 adds per-head q/k norms and a second
RoPE base for its sliding-window (local) layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.backend import AttentionBackend, AttentionMetadata
from trillm.config import ModelConfig
from trillm.model_executor.layer_types import SLIDING, layer_windows
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.layers.vocab_parallel import gather_logits
from trillm.model_executor.model_config import parse_rope
from trillm.model_executor.models.decoder import ResidualStreamCausalLM
from trillm.model_executor.models.llama import (
    DecoderStack,
    LlamaAttention,
    LlamaDecoderFlags,
    LlamaMLP,
)

# config.json activation name -> F.gelu's ``approximate`` (registry.py lists these names)
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, all in fp32, cast back (HF's GemmaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> same
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GeluMLP(LlamaMLP):
    """The Llama gated MLP with gelu (tanh-approximated by default) in place of silu."""

    def __init__(self, cfg: ModelConfig, approximate: str) -> None:
        super().__init__(cfg, bias=False)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I / N] each (this rank's)
        return self.tp.all_reduce(self.down_proj(F.gelu(gate, approximate=self.approximate) * up))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        flags: LlamaDecoderFlags,
        window: int | None,
        sandwich: bool,  # Gemma 2/3: norms after attention and the MLP too
    ) -> None:
        super().__init__()
        hf = cfg.hf_config
        scalar = hf.get("query_pre_attn_scalar")
        self.self_attn = LlamaAttention(
            cfg,
            backend,
            flags,
            window,
            scale=None if scalar is None else float(scalar) ** -0.5,
            softcap=hf.get("attn_logit_softcapping"),
            norm=GemmaRMSNorm,
        )
        self.mlp = GeluMLP(cfg, _GELU[cfg.hidden_act])
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        # Gemma 1: the pre-MLP norm; Gemma 2/3: the post-attention one.
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.sandwich = sandwich
        if sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H] residual stream
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, kv_cache, meta)
        if not self.sandwich:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(DecoderStack):
    SANDWICH = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        windows = layer_windows(cfg.hf_config, cfg.architecture, cfg.num_hidden_layers)
        layers = (GemmaDecoderLayer(cfg, backend, flags, w, self.SANDWICH) for w in windows)
        self.assemble(cfg, layers, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))


class Gemma2Model(GemmaModel):
    SANDWICH = True


class GemmaForCausalLM(ResidualStreamCausalLM):
    MODEL_CLASS = GemmaModel
    SCALE_EMBEDDINGS = True

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(cfg, backend, device)
        self.local_rotary = self.rotary  # Gemma 3 gives its sliding-window layers their own
        self.final_softcap = cfg.hf_config.get("final_logit_softcapping")

    def rotary_for(self, layer: nn.Module) -> RotaryEmbedding:
        assert isinstance(layer, GemmaDecoderLayer)
        return self.rotary if layer.self_attn.window is None else self.local_rotary

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        logits = gather_logits(self.lm_head(hidden), self.config.vocab_size, self.tp)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    MODEL_CLASS = Gemma2Model


class Gemma3ForCausalLM(GemmaForCausalLM):
    MODEL_CLASS = Gemma2Model
    QK_NORM = True

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(cfg, backend, device)
        params = cfg.hf_config.get("rope_parameters") or {}
        if isinstance(params.get(SLIDING), dict):  # transformers 5: one rope per layer type
            theta, scaling = parse_rope({**cfg.hf_config, "rope_parameters": params[SLIDING]})
        else:  # transformers 4: a plain base for the local layers
            theta, scaling = float(cfg.hf_config.get("rope_local_base_freq", 10000.0)), None
        self.local_rotary = RotaryEmbedding(
            cfg.head_dim,
            theta,
            scaling,
            cfg.max_position_embeddings,
            max_positions=cfg.max_model_len,
            device=device,
        )
