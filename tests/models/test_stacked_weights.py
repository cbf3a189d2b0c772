"""The one stacked-weight loader the Llama family and the EAGLE / MTP heads load through:
shards into their rows, completeness per stacked parameter, errors naming the checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trillm.model_executor.models.stacked_weights import (
    MissingWeightsError,
    StackedLinear,
    StackedWeightLoader,
)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = StackedLinear(4, {"q": 4, "k": 2, "v": 2}, bias=False)
        self.q_proj = nn.Linear(4, 3, bias=False)  # a projection of its own (MLA's)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()
        self.norm = nn.Parameter(torch.zeros(4))


def _loader(block: _Block, what: str = "Checkpoint") -> StackedWeightLoader:
    return StackedWeightLoader(block, dict(block.named_parameters()), what)


def _shards() -> dict[str, torch.Tensor]:
    return {
        p: torch.full((n, 4), float(i)) for i, (p, n) in enumerate([("q", 4), ("k", 2), ("v", 2)])
    }


def test_shards_fill_their_rows_and_complete_the_stacked_parameter() -> None:
    block = _Block()
    loader = _loader(block)
    for shard, tensor in _shards().items():
        loader.load(f"self_attn.{shard}_proj.weight", tensor)
    loader.load("self_attn.q_proj.weight", torch.ones(3, 4), stacked=False)
    loader.load("norm", torch.ones(4))
    loader.check_complete()
    rows = block.self_attn.qkv_proj.weight[:, 0].tolist()
    assert rows == [0.0] * 4 + [1.0] * 2 + [2.0] * 2
    assert torch.equal(block.self_attn.q_proj.weight, torch.ones(3, 4))


def test_a_missing_shard_leaves_its_stacked_parameter_missing() -> None:
    block = _Block()
    loader = _loader(block, "EAGLE head checkpoint")
    shards = _shards()
    del shards["v"]
    for shard, tensor in shards.items():
        loader.load(f"self_attn.{shard}_proj.weight", tensor)
    loader.load("self_attn.q_proj.weight", torch.ones(3, 4), stacked=False)
    loader.load("norm", torch.ones(4))
    with pytest.raises(
        MissingWeightsError,
        match=r"^EAGLE head checkpoint is missing 1 weight\(s\), e\.g\. \['self_attn\.qkv_proj\.weight'\]",
    ):
        loader.check_complete()


def test_misfits_are_refused_naming_the_weight() -> None:
    loader = _loader(_Block(), "The MTP layer's checkpoint")
    with pytest.raises(
        MissingWeightsError, match=r"^The MTP layer's checkpoint has an unexpected weight 'extra'"
    ):
        loader.load("extra", torch.ones(1))
    with pytest.raises(
        MissingWeightsError, match=r"^Weight 'norm' has shape \(5,\), expected \(4,\)"
    ):
        loader.load("norm", torch.ones(5))
    with pytest.raises(
        MissingWeightsError, match=r"^Shard 'k' weight of shape \(3, 4\) does not fit 2 rows"
    ):
        loader.load("self_attn.k_proj.weight", torch.ones(3, 4))
