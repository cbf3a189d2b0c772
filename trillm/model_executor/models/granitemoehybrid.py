"""GraniteMoeHybrid (transformers' ``GraniteMoeHybridForCausalLM``, IBM Granite 4.0-H): Mamba-2
layers (``mamba2.py``) and attention layers at ``layer_types``, each followed by a mixture of
experts plus a shared MLP, with Granite's multipliers.

As transformers computes it: the embeddings times ``embedding_multiplier``; each sublayer's
output times ``residual_multiplier`` before its residual add; attention scaled by
``attention_multiplier`` (not ``head_dim ** -0.5``), rotated only with
``position_embedding_type: "rope"``; the experts' router a softmax over its top-k logits (the
same weights as a softmax over all, renormalized); the logits divided by ``logits_scaling``.
The checkpoint's fused expert tensors (``input_linear`` [E, 2I, H]: gate rows then up rows,
``output_linear`` [E, H, I]) are ``FusedMoE``'s layout. Like Bamba, only the attention layers
hold the paged KV cache; a pipeline stage holds its own layers' states. Tensor parallelism: each rank holds its share of the experts' and
the shared MLP's intermediate size (``trillm/distributed/hybrid_sharding.py``); their partial
sums are all-reduced together, once per layer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from trillm.attention.backend import AttentionBackend, AttentionMetadata
from trillm.attention.ssm_state import SSMStateLayout
from trillm.config import ModelConfig
from trillm.distributed.parallel_state import get_tp_group
from trillm.distributed.pipeline import IntermediateTensors
from trillm.kernels.dispatch import silu_and_mul
from trillm.model_executor.layers.fused_moe import FusedMoE
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.llama import (
    DecoderStack,
    LlamaAttention,
    LlamaDecoderFlags,
    LlamaForCausalLM,
)
from trillm.model_executor.models.mamba2 import Mamba2Mixer, hybrid_state_layout, mixer_rows
from trillm.model_executor.models.moe import check_experts_loaded, refuse_quantized_experts

# The checkpoint's fused expert tensors -> FusedMoE.load_fused's names.
_EXPERT_TENSORS = {"input_linear.weight": "gate_up_proj", "output_linear.weight": "down_proj"}


class GraniteAttention(LlamaAttention):
    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        rotary: RotaryEmbedding | None,  # None: position_embedding_type is not "rope"
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        q, k, v = self.project_qkv(hidden)
        if rotary is not None:
            rotary(positions, q, k)
        return self.project_out(self.backend.forward(q, k, v, kv_cache, meta, self.scale))


class SharedMLP(nn.Module):
    """``output_linear(silu(gate) * up)`` with gate | up the halves of ``input_linear``
    (``inter``: this rank's share; the caller all-reduces the output)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * inter, bias=False)
        self.output_linear = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.output_linear(silu_and_mul(self.input_linear(x)))


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class GraniteMoE(nn.Module):
    """The routed experts (``block_sparse_moe``: its ``router.layer`` and fused experts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        num_experts, top_k = int(hf["num_local_experts"]), int(hf["num_experts_per_tok"])
        self.router = Router(cfg.hidden_size, num_experts)  # replicated
        inter = cfg.intermediate_size // get_tp_group().world_size  # this rank's share
        self.experts = FusedMoE(num_experts, top_k, cfg.hidden_size, inter, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.experts(x, self.router.layer(x))


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        flags: LlamaDecoderFlags,
        mixer_index: int | None,  # its row among the Mamba-2 layers; None: an attention layer
    ) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.multiplier = float(hf["residual_multiplier"])
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: GraniteAttention | None = None
        if mixer_index is None:
            scale = float(hf["attention_multiplier"])
            self.self_attn = GraniteAttention(cfg, backend, flags, scale=scale)
        else:
            self.mamba = Mamba2Mixer(cfg, mixer_index)
        self.block_sparse_moe = GraniteMoE(cfg) if int(hf["num_local_experts"]) else None
        self.tp = get_tp_group()
        shared = int(hf["shared_intermediate_size"]) // self.tp.world_size
        self.shared_mlp = SharedMLP(cfg.hidden_size, shared)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: the previous layer's MLP output (the embeddings first)
        residual: torch.Tensor | None,  # [T, H]: the residual stream so far (None: first layer)
        rotary: RotaryEmbedding | None,
        kv_cache: torch.Tensor | None,  # an attention layer's paged cache
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, unscaled; residual stream)
        """transformers' ``residual + sublayer(norm(residual)) * residual_multiplier`` twice,
        each add folded into the next norm; the caller scales the returned output likewise."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden * self.multiplier, residual)
        if self.mamba is not None:
            assert meta.ssm is not None, "a Mamba-2 layer runs with the step's state view"
            hidden = self.mamba(hidden, meta.ssm)
        else:
            assert self.self_attn is not None and kv_cache is not None
            hidden = self.self_attn(positions, hidden, rotary, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden * self.multiplier, residual)
        out = self.shared_mlp(hidden)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(hidden) + out
        return self.tp.all_reduce(out), residual  # the ranks' partial sums


class GraniteMoeHybridModel(DecoderStack):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags
    ) -> None:
        super().__init__()
        rows = mixer_rows(cfg.hf_config["layer_types"])
        self.assemble(
            cfg,
            (GraniteMoeHybridDecoderLayer(cfg, backend, flags, row) for row in rows),
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    MODEL_CLASS = GraniteMoeHybridModel

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        refuse_quantized_experts(cfg, "the experts' fused tensors")
        super().__init__(cfg, backend, device)
        hf = cfg.hf_config
        self.embedding_multiplier = float(hf["embedding_multiplier"])
        self.residual_multiplier = float(hf["residual_multiplier"])
        self.logits_scaling = float(hf["logits_scaling"])
        self.rope = self.rotary if hf.get("position_embedding_type") == "rope" else None

    @classmethod
    def decoder_flags(cls, cfg: ModelConfig) -> LlamaDecoderFlags:
        bias = bool(cfg.hf_config.get("attention_bias", False))
        return LlamaDecoderFlags(qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # the stage's attention layers' caches, in layer order
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # from the stage before (not stage 0)
    ) -> torch.Tensor | IntermediateTensors:  # [T, H]; what the next stage needs if any
        if intermediate is None:
            hidden = self.embed_input_ids(input_ids) * self.embedding_multiplier
            residual = None
        else:  # the last layer's unscaled MLP output and the stream
            hidden, residual = intermediate.hidden, intermediate.residual
        caches = iter(kv_caches)
        for layer in self.stage_layers():
            kv_cache = next(caches) if layer.self_attn is not None else None
            hidden, residual = layer(positions, hidden, residual, self.rope, kv_cache, meta)
        if not self.pp.is_last:
            return IntermediateTensors(hidden, residual)
        norm: nn.Module = self.model.norm
        return norm(hidden * self.residual_multiplier, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        return super().compute_logits(hidden) / self.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The fused expert tensors into their ``FusedMoE``, the rest as Llama's."""
        rest = []
        for name, tensor in weights:
            module, _, suffix = name.partition(".block_sparse_moe.")
            if suffix in _EXPERT_TENSORS:
                experts = self.get_submodule(f"{module}.block_sparse_moe.experts")
                assert isinstance(experts, FusedMoE)
                experts.load_fused(_EXPERT_TENSORS[suffix], tensor)
            else:
                rest.append((name, tensor))
        super().load_weights(rest)
        check_experts_loaded(self)

    @classmethod
    def ssm_state_layout(cls, cfg: ModelConfig, tp_size: int = 1) -> SSMStateLayout:
        return hybrid_state_layout(cfg, tp_size)
