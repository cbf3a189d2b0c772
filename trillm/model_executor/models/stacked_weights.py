"""Stacked projections and the one loop that loads HF-named checkpoints into them.

Decoders run q/k/v and gate/up as one matmul each (``StackedLinear``); checkpoints name the
projections apart (``...self_attn.q_proj.weight``). ``STACKED_PARAMS`` maps an HF projection onto
its stacked module and shard, and ``StackedWeightLoader`` copies a checkpoint in by those names:
the Llama family's ``load_weights`` and the EAGLE / MTP draft heads all load through it.
"""

from __future__ import annotations

import torch
from torch import nn

# HF parameter suffix -> (stacked parameter suffix, shard name)
STACKED_PARAMS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class MissingWeightsError(ValueError):
    """The checkpoint lacks parameters the model needs (or has ones it does not know)."""


class StackedLinear(nn.Linear):
    """One matmul for several HF projections; ``shards`` maps a shard name to its out rows."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def load_shard(self, shard: str, param_kind: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = self.weight if param_kind == "weight" else self.bias
        if target is None or tensor.shape[0] != size:
            raise MissingWeightsError(
                f"Shard {shard!r} {param_kind} of shape {tuple(tensor.shape)} does not fit "
                f"{size} rows (or the layer has no {param_kind})."
            )
        target.data[start : start + size].copy_(tensor)


def load_plain(
    params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, what: str = "Checkpoint"
) -> None:
    """Copy ``tensor`` into the parameter of that name; MissingWeightsError when none fits."""
    if name not in params:
        raise MissingWeightsError(f"{what} has an unexpected weight {name!r}.")
    param = params[name]
    if param.shape != tensor.shape:
        raise MissingWeightsError(
            f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}."
        )
    param.data.copy_(tensor)


class StackedWeightLoader:
    """One pass of HF-named tensors into ``root``: a q/k/v/gate/up tensor into its shard of a
    ``StackedLinear``, any other into ``params`` by name. A stacked parameter counts as loaded
    once all its shards came; ``check_complete`` names what never did."""

    def __init__(self, root: nn.Module, params: dict[str, nn.Parameter], what: str) -> None:
        self.root = root
        self.params = params
        self.what = what  # the checkpoint's name in errors ("Checkpoint", "EAGLE head checkpoint")
        self.loaded: set[str] = set()
        self._shards_seen: dict[str, set[str]] = {}  # stacked param name -> shards loaded

    def load(self, name: str, tensor: torch.Tensor, *, stacked: bool = True) -> None:
        """``stacked=False``: ``name`` is its own projection even if it reads like a shard
        (MLA's ``q_proj``)."""
        module_path, _, kind = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        if not stacked or proj not in STACKED_PARAMS:
            load_plain(self.params, name, tensor, self.what)
            self.loaded.add(name)
            return
        stacked_name, shard = STACKED_PARAMS[proj]
        module = self._stacked_module(f"{parent}.{stacked_name}")
        module.load_shard(shard, kind, tensor)
        param_name = f"{parent}.{stacked_name}.{kind}"
        seen = self._shards_seen.setdefault(param_name, set())
        seen.add(shard)
        if seen == set(module.shard_offsets):
            self.loaded.add(param_name)

    def check_complete(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise MissingWeightsError(
                f"{self.what} is missing {len(missing)} weight(s), e.g. {missing[:5]}."
            )

    def _stacked_module(self, path: str) -> StackedLinear:
        module = self.root.get_submodule(path)
        if not isinstance(module, StackedLinear):
            raise MissingWeightsError(f"{path!r} is not a stacked projection.")
        return module
