"""Batched LoRA on the decoder's linears: one step may mix several adapters and the base model.

Each targeted linear (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` of every layer)
keeps its forward and gains a delta: for each adapter of the step, over that adapter's rows
only, ``y[rows] += scale * (x[rows] @ A^T) @ B^T`` (the shrink to rank r, then the expand).
Rows of base-model requests are not touched. For a stacked projection (q/k/v, gate/up) the
shards an adapter targets are stacked: ``A`` [R, in] is their A's one above the other, ``B``
[out, R] block-diagonal, so one shrink and one expand serve all shards.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

# HF projection -> (module path inside a decoder layer, shard of a stacked module or None)
TARGET_MODULES: dict[str, tuple[str, str | None]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None),
}


@dataclass
class StepGroups:
    """This step's rows grouped by adapter id (base-model rows are in no group)."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (id, rows [n] long)


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R]
    scale: float


class LoRALinear:
    """The LoRA state of one linear: its stacked weights per resident adapter."""

    def __init__(self, module: nn.Linear, step: StepGroups) -> None:
        self.module = module
        self.step = step
        self.weights: dict[int, LoRAWeights] = {}  # adapter id -> stacked A/B
        base: Callable[[torch.Tensor], torch.Tensor] = module.forward
        self._base = base

        def forward(_self: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
            return self.apply(x, self._base(x))

        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.step.groups or not self.weights:
            return y
        for adapter_id, rows in self.step.groups:
            w = self.weights.get(adapter_id)
            if w is None:  # this adapter does not target this linear
                continue
            xs = x.index_select(0, rows)  # [n, in]
            delta = (xs @ w.a.t()) @ w.b.t()  # shrink [n, R], expand [n, out]
            y.index_add_(0, rows, delta, alpha=w.scale)
        return y

    def out_rows(self, shard: str | None) -> tuple[int, int]:
        """(first output row, rows) of a shard of a stacked linear, or the whole output."""
        if shard is None:
            return 0, self.module.out_features
        offsets: dict[str, tuple[int, int]] = self.module.shard_offsets  # type: ignore[assignment]
        return offsets[shard]

    def set_adapter(
        self,
        adapter_id: int,
        parts: list[tuple[str | None, torch.Tensor, torch.Tensor]],  # (shard, A [r, in], B [o, r])
        scale: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        a = torch.cat([p[1] for p in parts])  # [R, in]
        b = torch.zeros(self.module.out_features, a.shape[0])  # [out, R]
        r0 = 0
        for shard, _, b_part in parts:
            start, size = self.out_rows(shard)
            b[start : start + size, r0 : r0 + b_part.shape[1]] = b_part
            r0 += b_part.shape[1]
        self.weights[adapter_id] = LoRAWeights(
            a.to(device=device, dtype=dtype).contiguous(),
            b.to(device=device, dtype=dtype).contiguous(),
            scale,
        )


def attach_lora(model: object, step: StepGroups) -> dict[tuple[int, str], LoRALinear]:
    """Wraps every targetable linear of the decoder -> (layer, module path) -> its state.
    Runs after the weights are loaded and packed (the wrapped forward is the packed one)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder layers: LoRA cannot run on it.")
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(layers):
        for path, _ in set(TARGET_MODULES.values()):
            module = layer.get_submodule(path)
            if not isinstance(module, nn.Linear):
                raise TypeError(f"layer {index} {path} is not a linear layer: LoRA cannot run.")
            wrapped[(index, path)] = LoRALinear(module, step)
    return wrapped
