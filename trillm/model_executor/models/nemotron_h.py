"""Nemotron-H (transformers' ``NemotronHForCausalLM``): a stack of single-sublayer blocks, each
``residual + mixer(norm(residual))`` with a mixer of the kind ``layer_types`` gives
(``nemotron_h_config``): a Mamba-2 layer (``mamba2.py``, shared with Bamba), attention without
any positional embedding, an MLP of ``relu(up(x)) ** 2`` or a mixture of such experts
(``nemotron_h_ffn.py``).

As transformers computes it: its RMSNorm multiplies the weight in float32 and casts the product
back (Llama's casts before the weight); the attention has no bias and scales by
``head_dim ** -0.5``; the head is never tied to the embeddings. The attention layers alone hold
the paged KV cache, the Mamba-2 layers a per-request state (``ssm_state_layout``), the MLP
and expert layers neither. Checkpoint names (``backbone.embeddings``, ``backbone.layers.N.mixer.*``,
``backbone.norm_f``) map onto Llama's stack (``model.embed_tokens``, ``model.norm``); the multi-token
prediction layers (``mtp.*``) are skipped, as transformers skips them. Tensor parallelism
splits the Mamba-2 layers by heads (``trillm/distributed/hybrid_sharding.py``), the attention
and MLP layers as Llama's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from trillm.attention.backend import AttentionBackend, AttentionMetadata
from trillm.attention.ssm_state import SSMStateLayout
from trillm.config import ModelConfig
from trillm.distributed.pipeline import IntermediateTensors
from trillm.model_executor.bamba_config import ATTENTION, MAMBA
from trillm.model_executor.models.granitemoehybrid import GraniteAttention
from trillm.model_executor.models.llama import DecoderStack, LlamaDecoderFlags, LlamaForCausalLM
from trillm.model_executor.models.mamba2 import Mamba2Mixer, hybrid_state_layout, mixer_rows
from trillm.model_executor.models.nemotron_h_ffn import NemotronHMLP, NemotronHMoE
from trillm.model_executor.nemotron_h_config import MOE

# Checkpoint prefixes (NVIDIA's ``backbone.*``, as transformers saves them too) -> this stack's
# names (Llama's).
_RENAMED = {
    "backbone.embeddings.": "model.embed_tokens.",
    "backbone.norm_f.": "model.norm.",
    "backbone.": "model.",
}
_MTP = "mtp."  # the multi-token-prediction layers transformers does not load either


class NemotronHRMSNorm(nn.Module):
    """RMSNorm in float32 with the weight multiplied before the cast back, optionally after the
    residual add (``residual += x`` in place, then the norm of ``residual``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        if residual is not None:
            x = residual.add_(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class NemotronHBlock(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        flags: LlamaDecoderFlags,
        kind: str,
        mixer_index: int | None,  # its row among the Mamba-2 layers (a Mamba-2 layer's)
    ) -> None:
        super().__init__()
        self.kind = kind
        self.norm = NemotronHRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer: nn.Module
        if kind == MAMBA:
            assert mixer_index is not None
            self.mixer = Mamba2Mixer(cfg, mixer_index)
        elif kind == ATTENTION:
            self.mixer = GraniteAttention(cfg, backend, flags)  # scale head_dim ** -0.5
        elif kind == MOE:
            self.mixer = NemotronHMoE(cfg, flags.mlp_bias)
        else:
            self.mixer = NemotronHMLP(cfg, flags.mlp_bias)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: the previous block's mixer output (the embeddings first)
        residual: torch.Tensor | None,  # [T, H]: the residual stream so far (None: first block)
        kv_cache: torch.Tensor | None,  # an attention layer's paged cache
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (mixer output, residual stream), both [T, H]
        """transformers' ``residual + mixer(norm(residual))``, the add folded into the next
        norm: the stream after this block is ``residual + returned output``."""
        if residual is None:
            residual = hidden
            hidden = self.norm(hidden)
        else:
            hidden = self.norm(hidden, residual)
        if self.kind == MAMBA:
            assert meta.ssm is not None, "a Mamba-2 layer runs with the step's state view"
            return self.mixer(hidden, meta.ssm), residual
        if self.kind == ATTENTION:
            assert kv_cache is not None
            return self.mixer(positions, hidden, None, kv_cache, meta), residual  # no RoPE
        return self.mixer(hidden), residual


class NemotronHModel(DecoderStack):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags
    ) -> None:
        super().__init__()
        kinds = cfg.hf_config["layer_types"]
        rows = mixer_rows(kinds)
        self.assemble(
            cfg,
            (NemotronHBlock(cfg, backend, flags, k, row) for k, row in zip(kinds, rows)),
            NemotronHRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )


class NemotronHForCausalLM(LlamaForCausalLM):
    MODEL_CLASS = NemotronHModel

    @classmethod
    def decoder_flags(cls, cfg: ModelConfig) -> LlamaDecoderFlags:
        mlp_bias = bool(cfg.hf_config["mlp_bias"])
        return LlamaDecoderFlags(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=mlp_bias)

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
            kv_cache = next(caches) if layer.kind == ATTENTION else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if not self.pp.is_last:
            return IntermediateTensors(hidden, residual)
        norm: nn.Module = self.model.norm
        return norm(hidden, residual)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (_renamed(name), tensor) for name, tensor in weights if not name.startswith(_MTP)
        )

    @classmethod
    def own_projection(cls, name: str) -> bool:
        """Every ``up_proj`` is a whole projection (no MLP or expert here has a gate)."""
        return ".up_proj." in name

    @classmethod
    def ssm_state_layout(cls, cfg: ModelConfig, tp_size: int = 1) -> SSMStateLayout:
        return hybrid_state_layout(cfg, tp_size)


def _renamed(name: str) -> str:
    for prefix, ours in _RENAMED.items():
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return name
