"""Sleep level 1's weight offload (``trillm/worker/weight_offload.py``), on CPU as host and
device: the device tensors are emptied and the same parameter objects get their weights back,
tied weights included, and the model computes what it computed before."""

from __future__ import annotations

import torch

from trillm.worker import weight_offload


def _tied_model() -> torch.nn.Module:
    torch.manual_seed(0)
    embed = torch.nn.Embedding(11, 8)
    head = torch.nn.Linear(8, 11, bias=False)
    head.weight = embed.weight  # tied, as many checkpoints are
    model = torch.nn.Sequential(embed, torch.nn.LayerNorm(8), head)
    model.register_buffer("scale", torch.tensor([2.0]))
    return model


def test_offload_empties_the_tensors_and_restore_gives_the_same_output():
    model = _tied_model()
    ids = torch.tensor([1, 5, 9])
    expected = model(ids) * model.scale
    params = [id(p) for p in model.parameters()]
    host = weight_offload.offload(model)
    assert all(t.numel() == 0 for t in (*model.parameters(), *model.buffers()))
    assert set(host) == {"0.weight", "1.weight", "1.bias", "scale"}  # the tied head once
    weight_offload.restore(model, host, torch.device("cpu"))
    assert [id(p) for p in model.parameters()] == params
    assert model[2].weight is model[0].weight
    assert torch.equal(model(ids) * model.scale, expected)
