"""DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): Multi-head Latent
Attention on a latent KV cache (``deepseek_mla.py``), the first ``first_k_dense_replace``
layers with a dense MLP, the others a mixture of experts with shared experts and DeepSeek's
routers, as transformers computes them:

- V2: softmax scores; ``greedy`` top-k, or ``group_limited_greedy`` (the ``topk_group`` groups
  with the best single expert, the others' scores zeroed); weights times
  ``routed_scaling_factor``, not renormalized.
- V3 (``noaux_tc``): sigmoid scores; experts chosen on score + ``e_score_correction_bias``
  within the ``topk_group`` groups of best top-2 sums (the others masked out); weights are the
  unbiased scores, renormalized by ``norm_topk_prob``, times ``routed_scaling_factor``.

The config is read and checked by ``trillm/model_executor/deepseek_config.py``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.backend import AttentionBackend
from trillm.attention.kv_layout import KVCacheLayout
from trillm.config import ModelConfig
from trillm.distributed.parallel_state import get_tp_group
from trillm.model_executor.deepseek_config import V3
from trillm.model_executor.layers.fused_moe import FusedMoE, expert_inter
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.models.deepseek_mla import MLAAttention, MLAPlan
from trillm.model_executor.models.llama import (
    DecoderStack,
    FoldedResidualLayer,
    LlamaDecoderFlags,
    LlamaMLP,
)
from trillm.model_executor.models.moe import MoEForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekRouter(nn.Module):
    """HF's ``mlp.gate``: ``weight`` [E, H] (and V3's ``e_score_correction_bias`` [E]), kept
    and scored in fp32 whatever the model's dtype, as transformers does; ``noaux_tc``: V3's
    router whatever the architecture (Nemotron-H's experts use it)."""

    def __init__(self, cfg: ModelConfig, noaux_tc: bool = False) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.v3 = noaux_tc or cfg.architecture == V3
        self.num_experts, self.top_k = int(hf["n_routed_experts"]), int(hf["num_experts_per_tok"])
        fp32 = torch.float32
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size, dtype=fp32))
        if self.v3:
            bias = torch.zeros(self.num_experts, dtype=fp32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        grouped = self.v3 or hf.get("topk_method") == "group_limited_greedy"
        self.num_groups = int(hf["n_group"]) if grouped else 1
        self.topk_group = int(hf["topk_group"]) if grouped else 1
        self.renormalize = self.v3 and bool(hf.get("norm_topk_prob"))
        self.scaling = float(hf["routed_scaling_factor"])

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> weights [T, k] fp32, ids [T, k]
        logits = F.linear(x.float(), self.weight)  # [T, E]
        if self.v3:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
        else:
            scores = choice = logits.softmax(dim=-1)
        if self.num_groups > 1 or self.v3:
            choice = self._best_groups_only(choice)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def _best_groups_only(self, choice: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        """The scores of the ``topk_group`` best groups; the others' -inf (V3) or 0 (V2)."""
        grouped = choice.view(choice.shape[0], self.num_groups, -1)  # [T, G, E / G]
        if self.v3:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        fill = float("-inf") if self.v3 else 0.0
        return grouped.masked_fill(~keep[..., None], fill).view_as(choice)


class DeepseekMoE(nn.Module):
    """Routed experts (one ``FusedMoE``) plus the shared experts' MLP; HF's module names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        inter = int(hf["moe_intermediate_size"])
        self.gate = DeepseekRouter(cfg)  # replicated
        # Tensor parallelism: every rank holds every expert's share of its I (sharding.py).
        self.tp = get_tp_group()
        self.experts = FusedMoE(
            self.gate.num_experts,
            self.gate.top_k,
            cfg.hidden_size,
            expert_inter(inter),  # each expert's 1 / N, or whole under expert parallelism
            renormalize=False,
        )
        shared = dataclasses.replace(cfg, intermediate_size=inter * int(hf["n_shared_experts"]))
        self.shared_experts = LlamaMLP(shared, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(x)
        routed = self.tp.all_reduce(self.experts.run(x, weights, ids))  # the ranks' partial sums
        return routed + self.shared_experts(x)  # LlamaMLP all-reduces its own


class DeepseekDecoderLayer(FoldedResidualLayer):
    """MLA and a dense or mixture-of-experts MLP, with the Llama layer's folded residual."""

    def __init__(self, cfg: ModelConfig, plan: MLAPlan, index: int) -> None:
        super().__init__()
        hf = cfg.hf_config
        interleaved = cfg.architecture != V3 or bool(hf.get("rope_interleave", True))
        self.self_attn = MLAAttention(cfg, plan, interleaved)
        dense = index < int(hf.get("first_k_dense_replace") or 0)
        self.mlp = LlamaMLP(cfg, bias=False) if dense else DeepseekMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        plan = MLAPlan()  # one per step, shared by the layers
        layers = (DeepseekDecoderLayer(cfg, plan, i) for i in range(cfg.num_hidden_layers))
        self.assemble(cfg, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))


class DeepseekV2ForCausalLM(MoEForCausalLM):
    MODEL_CLASS = DeepseekModel

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        if backend.name != "torch":
            raise ValueError(
                f"{cfg.architecture}: --attention-backend {backend.name} is not supported: MLA "
                "attends over its latent cache in its own torch ops (the default for these "
                "models); use --attention-backend torch."
            )
        if cfg.numerics == "transformers":
            raise ValueError(
                f"{cfg.architecture}: numerics='transformers' is not supported (its MLA "
                "attention has no transformers-order path); use numerics='fast'."
            )
        super().__init__(cfg, backend, device)

    @classmethod
    def kv_cache_layout(cls, cfg: ModelConfig, num_kv_heads: int) -> KVCacheLayout:
        """The latent (after kv_a_layernorm) and the roped key, one row per token."""
        hf = cfg.hf_config
        return KVCacheLayout(1, (1, int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"])))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._without_mtp_layers(weights))

    def _without_mtp_layers(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Skips the multi-token-prediction layers (numbered after the decoder's), as
        transformers does."""
        for name, tensor in weights:
            match = _LAYER.match(name)
            if match is None or int(match.group(1)) < self.config.num_hidden_layers:
                yield name, tensor

    @classmethod
    def own_projection(cls, name: str) -> bool:
        """MLA's ``q_proj`` is its own projection, not a share of a stacked q/k/v."""
        return ".self_attn." in name


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3: the noaux_tc router and (``rope_interleave``) V2's interleaved RoPE pairs."""
