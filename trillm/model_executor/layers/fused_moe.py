"""The mixture-of-experts FFN of Mixtral and Qwen MoE models (stage 7).

``SparseMoeBlock``: a router (``gate``, [E, H]) picks ``top_k`` experts per token
(``select_experts``: softmax in fp32, top-k, renormalized when the model says so), the experts
run as one ``FusedMoE``, and Qwen2-MoE adds a sigmoid-gated shared expert. ``FusedMoE`` holds
every expert's weights in two tensors (Hugging Face's fused layout: ``w13`` [E, 2I, H] = gate
rows then up rows, ``w2`` [E, H, I]) and dispatches by device: the native grouped GEMMs on CPU
fp32 (``kernels/fused_moe_cpu.py``, experts packed once on first use), the Triton kernels on
GPU (``kernels/fused_moe_triton.py``), the torch reference otherwise
(``kernels/fused_moe_torch.py``).

The expert tensors are buffers, not parameters: the decoder's loader loads them here
(``load_expert`` / ``load_fused``), from per-expert checkpoint names (``experts.N.w1`` or
``experts.N.gate_proj``, as checkpoints on the hub store them) or the fused ones, and
``check_loaded`` names any expert weight the checkpoint lacked.

Expert parallelism (``--enable-expert-parallel``): a rank's ``FusedMoE`` holds only its block
of the experts, whole, and ``run`` sends each token to the ranks of its experts and back
(``trillm/distributed/expert_parallel.py``); without it each rank holds every expert's share of
its intermediate size (``expert_inter``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from trillm.config import ModelConfig
from trillm.distributed.expert_parallel import ExpertPlacement, dispatch_combine
from trillm.distributed.parallel_state import get_tp_group
from trillm.kernels import fused_moe_cpu, fused_moe_torch
from trillm.kernels.fused_moe_torch import select_experts
from trillm.model_executor.models.llama import LlamaMLP

# Checkpoint names of one expert's projections -> the part of w13 / w2 they fill.
EXPERT_PARTS = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


def expert_inter(inter: int) -> int:
    """This rank's share of a routed expert's intermediate size ``inter``: its 1 / N under
    tensor parallelism, the whole of it under expert parallelism."""
    tp = get_tp_group()
    return inter if tp.expert_parallel else inter // tp.world_size


class FusedMoE(nn.Module):
    # E_r: this rank's experts (all E but under expert parallelism: E / N)
    w13: torch.Tensor  # [E_r, 2I, H] buffer: each expert's gate rows, then its up rows
    w2: torch.Tensor  # [E_r, H, I] buffer

    def __init__(
        self, num_experts: int, top_k: int, hidden: int, inter: int, renormalize: bool
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}.")
        self.num_experts, self.top_k, self.inter = num_experts, top_k, inter
        self.renormalize = renormalize
        self.placement = ExpertPlacement.current(num_experts)
        held = self.placement.per_rank
        self.register_buffer("w13", torch.empty(held, 2 * inter, hidden))
        self.register_buffer("w2", torch.empty(held, hidden, inter))
        self._loaded: set[tuple[int, str]] = set()
        self._packed: fused_moe_cpu.PackedExperts | None = None

    # ------------------------------------------------------------ loading
    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One expert's gate [I, H], up [I, H] or down [H, I] projection."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"Expert {expert} is past num_experts={self.num_experts}.")
        if not self.placement.holds(expert):  # the loader reads only this rank's experts
            raise ValueError(f"Expert {expert} is held by another expert-parallel rank.")
        local = expert - self.placement.start
        if part == "down":
            target = self.w2[local]
        else:
            start = 0 if part == "gate" else self.inter
            target = self.w13[local, start : start + self.inter]
        if tensor.shape != target.shape:
            raise ValueError(
                f"Expert {expert} {part} has shape {tuple(tensor.shape)}, the "
                f"model expects {tuple(target.shape)}."
            )
        with torch.no_grad():
            target.copy_(tensor)
        self._loaded.add((expert, part))
        self._packed = None

    def load_fused(self, name: str, tensor: torch.Tensor) -> None:
        """The fused tensors (``gate_up_proj`` [E_r, 2I, H], ``down_proj`` [E_r, H, I]: this
        rank's experts)."""
        target, parts = (
            (self.w13, ("gate", "up")) if name == "gate_up_proj" else (self.w2, ("down",))
        )
        if tensor.shape != target.shape:
            raise ValueError(
                f"experts.{name} has shape {tuple(tensor.shape)}, the model "
                f"expects {tuple(target.shape)}."
            )
        with torch.no_grad():
            target.copy_(tensor)
        self._loaded.update((e, p) for e in self._held() for p in parts)
        self._packed = None

    def _held(self) -> range:
        """This rank's experts, by their index in the model."""
        return range(self.placement.start, self.placement.start + self.placement.per_rank)

    def missing(self) -> list[str]:
        return [
            f"{e}.{p}"
            for e in self._held()
            for p in ("gate", "up", "down")
            if (e, p) not in self._loaded
        ]

    # ------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        router_logits: torch.Tensor,  # [T, E]
    ) -> torch.Tensor:  # [T, H]
        return self.run(x, *select_experts(router_logits, self.top_k, self.renormalize))

    def run(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] fp32, each token's routing weights
        ids: torch.Tensor,  # [T, k] int64, its experts (a model's own router: DeepSeek's)
    ) -> torch.Tensor:  # [T, H]; under expert parallelism this rank's token slice, zeros
        # elsewhere: the caller's all-reduce of the ranks' partial outputs assembles them
        if self.placement.size > 1:
            return dispatch_combine(self.placement, x, weights, ids, self._run_held)
        return self._run_held(x, weights, ids)

    def _run_held(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] fp32
        ids: torch.Tensor,  # [T, k] int64, among this rank's experts (0 .. E_r - 1)
    ) -> torch.Tensor:  # [T, H]
        if fused_moe_cpu.supports(x, self.w13):
            if self._packed is None:
                self._packed = fused_moe_cpu.PackedExperts(self.w13, self.w2)
            return fused_moe_cpu.fused_moe(x, self._packed, weights, ids)
        if x.device.type == "cuda":
            from trillm.kernels import fused_moe_triton

            return fused_moe_triton.fused_moe(x, self.w13, self.w2, weights, ids)
        return fused_moe_torch.fused_moe(x, self.w13, self.w2, weights, ids)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert); HF's module names."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_experts: int,
        top_k: int,
        inter: int,
        renormalize: bool,
        shared_inter: int = 0,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, num_experts, bias=False)  # replicated
        # Tensor parallelism: every rank holds every expert's share of its I (sharding.py);
        # expert parallelism: its experts whole.
        self.tp = get_tp_group()
        self.experts = FusedMoE(
            num_experts, top_k, cfg.hidden_size, expert_inter(inter), renormalize
        )
        self.shared_expert: nn.Module | None = None
        if shared_inter:
            shared_cfg = dataclasses.replace(cfg, intermediate_size=shared_inter)
            self.shared_expert = LlamaMLP(shared_cfg, bias=False)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = self.tp.all_reduce(self.experts(x, self.gate(x)))  # the ranks' partial sums
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def exchange_without_tokens(
    model: nn.Module, dtype: torch.dtype, device: torch.device, skip: int = 0
) -> int:
    """An idle engine core's rank's share of a step the other cores run (-dp N -ep): every
    expert-parallel layer's exchanges in the model's order (the order a forward reaches them)
    with no tokens of its own, its experts run on the rows the others send; no attention, no
    KV write, no sampling (trillm/engine/dp_lockstep.py). ``skip``: the first layers, done
    already by a forward that then failed. -> the layers taken part in."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.placement.size > 1]
    layers = layers[skip:]
    with torch.inference_mode():
        for layer in layers:
            x = torch.empty(0, layer.w2.shape[1], dtype=dtype, device=device)  # [0, H]
            weights = torch.empty(0, layer.top_k, dtype=torch.float32, device=device)
            ids = torch.empty(0, layer.top_k, dtype=torch.int64, device=device)
            dispatch_combine(layer.placement, x, weights, ids, layer._run_held)
    return len(layers)
