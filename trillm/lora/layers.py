"""Batched LoRA on the decoder's linears: one step may mix several adapters and the base model.

Each targeted linear (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` of every layer)
keeps its forward and gains a delta, Punica-style: every resident adapter has a slot, the
step gives each token its adapter's slot (-1 for base-model tokens), and one shrink / expand
pair (``trillm.kernels.dispatch.add_lora_``: native on CPU, Triton on GPU) computes
``y[t] += scale[s] * (x[t] @ A[s]^T) @ B[s]^T`` for all tokens at once. Base-model rows are not
touched.

Per linear the slots' weights are stacked: ``a`` [L, R, in] and ``bt`` [L, R, out] (B
transposed), R = shards x max_lora_rank. Shard i of a stacked projection (q/k/v, gate/up) owns
rank rows ``i * max_rank ..``, its B block sits at that shard's output rows; a smaller rank or
an untargeted shard leaves zero rows, which add exactly nothing.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from trillm.kernels.dispatch import add_lora_

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


def _shards(path: str) -> list[str | None]:
    """The shards of a module path, in TARGET_MODULES order ([None] for a plain linear)."""
    return list(dict.fromkeys(s for p, s in TARGET_MODULES.values() if p == path))


@dataclass
class StepSlots:
    """This step's adapter slot per token, shared by every LoRA linear (the manager owns it)."""

    scales: torch.Tensor  # [L] fp32, each slot's adapter scale
    slots: torch.Tensor | None = None  # [T] int64, -1 = base model; None: no adapter this step
    used: frozenset[int] = field(default_factory=frozenset)  # slots with tokens this step


class LoRALinear:
    """The LoRA state of one linear: its slots' stacked weights."""

    def __init__(self, module: nn.Linear, path: str, step: StepSlots, max_rank: int) -> None:
        self.module = module
        self.step = step
        self.shards = _shards(path)
        self.max_rank = max_rank
        self.a: torch.Tensor | None = None  # [L, R, in], made with the first adapter
        self.bt: torch.Tensor | None = None  # [L, R, out]
        self.present: set[int] = set()  # slots whose adapter targets this linear
        base: Callable[[torch.Tensor], torch.Tensor] = module.forward
        self._base = base

        def forward(_self: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
            return self.apply(x, self._base(x))

        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        slots = self.step.slots
        if (
            slots is None
            or self.a is None
            or self.bt is None
            or self.present.isdisjoint(self.step.used)
        ):
            return y
        return add_lora_(y, x, self.a, self.bt, slots, self.step.scales)

    def out_rows(self, shard: str | None) -> tuple[int, int]:
        """(first output row, rows) of a shard of a stacked linear, or the whole output."""
        if shard is None:
            return 0, self.module.out_features
        offsets: dict[str, tuple[int, int]] = self.module.shard_offsets  # type: ignore[assignment]
        return offsets[shard]

    def _stacks(
        self, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.a is None or self.bt is None:
            rank = len(self.shards) * self.max_rank
            self.a = torch.zeros(
                num_slots, rank, self.module.in_features, dtype=dtype, device=device
            )
            self.bt = torch.zeros(
                num_slots, rank, self.module.out_features, dtype=dtype, device=device
            )
        return self.a, self.bt

    def set_adapter(
        self,
        slot: int,
        num_slots: int,
        parts: list[tuple[str | None, torch.Tensor, torch.Tensor]],  # (shard, A [r, in], B [o, r])
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        a, bt = self._stacks(num_slots, dtype, device)
        a[slot].zero_()
        bt[slot].zero_()
        for shard, a_part, b_part in parts:
            rank = a_part.shape[0]
            if rank > self.max_rank:
                raise ValueError(f"LoRA rank {rank} exceeds max_lora_rank {self.max_rank}.")
            r0 = self.shards.index(shard) * self.max_rank
            start, size = self.out_rows(shard)
            a[slot, r0 : r0 + rank] = a_part.to(device=device, dtype=dtype)
            bt[slot, r0 : r0 + rank, start : start + size] = b_part.t().to(
                device=device, dtype=dtype
            )
        self.present.add(slot)

    def clear(self, slot: int) -> None:
        """Zero the slot's rows: a later adapter in this slot may not target this linear."""
        if slot in self.present and self.a is not None and self.bt is not None:
            self.a[slot].zero_()
            self.bt[slot].zero_()
        self.present.discard(slot)


def attach_lora(model: object, step: StepSlots, max_rank: int) -> dict[tuple[int, str], LoRALinear]:
    """Wraps every targetable linear of the decoder -> (layer, module path) -> its state.
    Runs after the weights are loaded and packed (the wrapped forward is the packed one).
    A pipeline stage wraps only its own layers (the others are ``PPMissingLayer``)."""
    from trillm.distributed.pipeline import PPMissingLayer

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder layers: LoRA cannot run on it.")
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(layers):
        if isinstance(layer, PPMissingLayer):
            continue
        for path in dict.fromkeys(p for p, _ in TARGET_MODULES.values()):
            module = layer.get_submodule(path)
            if not isinstance(module, nn.Linear):
                raise TypeError(f"layer {index} {path} is not a linear layer: LoRA cannot run.")
            wrapped[(index, path)] = LoRALinear(module, path, step, max_rank)
    return wrapped
