"""Nemotron-H's feed-forward mixers: the relu2 MLP (a '-' / ``mlp`` block's) and the
mixture-of-experts layer (an 'E' / ``moe`` block's, Nemotron 3), the latter as transformers'
``NemotronHMoE`` computes it: DeepSeek-V3's router (``noaux_tc``: sigmoid scores,
``e_score_correction_bias``, ``n_group`` / ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``), experts that are not gated (``down(relu(up(x)) ** 2)``), optionally
on a latent width (``moe_latent_size``: ``fc1_latent_proj`` before them, ``fc2_latent_proj``
after their sum), plus a shared relu2 MLP of ``moe_shared_expert_intermediate_size`` on the
layer's input.

The experts run one by one over the tokens routed to each (a torch loop as transformers' own:
``FusedMoE``'s kernels compute gated SiLU experts). Tensor parallelism: each rank holds every
expert's and the shared MLP's share of their intermediate sizes (``sharding.py``); the experts'
partial sums are all-reduced before ``fc2_latent_proj``, the shared MLP's by itself.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from trillm.config import ModelConfig
from trillm.distributed.parallel_state import get_tp_group
from trillm.model_executor.models.deepseek import DeepseekRouter
from trillm.model_executor.models.llama import rank_shapes


class NemotronHMLP(nn.Module):
    """``down(relu(up(x)) ** 2)`` over this rank's share of ``intermediate_size``."""

    def __init__(self, cfg: ModelConfig, bias: bool) -> None:
        super().__init__()
        self.tp, shapes = rank_shapes(cfg)
        self.up_proj = nn.Linear(cfg.hidden_size, shapes.inter_size, bias=bias)
        self.down_proj = nn.Linear(shapes.inter_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.tp.all_reduce(self.down_proj(F.relu(self.up_proj(x)).square()))


class RoutedExpert(nn.Module):
    """One expert, ``down(relu(up(x)) ** 2)`` (this rank's share of its intermediate size)."""

    def __init__(self, width: int, inter: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width, inter, bias=False)
        self.down_proj = nn.Linear(inter, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, W] -> [n, W], partial under TP
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.tp = get_tp_group()
        self.gate = DeepseekRouter(cfg, noaux_tc=True)  # replicated
        latent = hf["moe_latent_size"]
        width = int(latent) if latent else cfg.hidden_size
        inter = int(hf["moe_intermediate_size"]) // self.tp.world_size
        self.experts = nn.ModuleList(
            RoutedExpert(width, inter) for _ in range(self.gate.num_experts)
        )
        shared = int(hf["moe_shared_expert_intermediate_size"])
        self.shared_experts = NemotronHMLP(dataclasses.replace(cfg, intermediate_size=shared), bias)
        self.fc1_latent_proj: nn.Module = nn.Identity()
        self.fc2_latent_proj: nn.Module = nn.Identity()
        if latent:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, width, bias=bias)
            self.fc2_latent_proj = nn.Linear(width, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(x)  # [T, k] fp32, [T, k]
        h = self.fc1_latent_proj(x)  # [T, W]
        routed = torch.zeros_like(h)
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            out = self.experts[expert](h[tokens]) * weights[tokens, slots, None]
            routed.index_add_(0, tokens, out.to(routed.dtype))
        routed = self.fc2_latent_proj(self.tp.all_reduce(routed))
        return routed + self.shared_experts(x)
