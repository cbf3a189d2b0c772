"""Sleep level 1 on an accelerator (vLLM's): the model's weights go to host memory and the
device's copies are freed; ``restore`` brings them back. The parameters and buffers stay the
same objects (only their ``.data`` is swapped), so whatever holds them (tied embeddings, the
LoRA layers' bases) sees the restored weights. On CPU the host is the device: nothing moves."""

from __future__ import annotations

from itertools import chain

import torch


def _tensors(model: object) -> dict[str, torch.Tensor]:  # the runner's CausalLM
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sleep mode moves a torch module's weights, not a {type(model)}.")
    return dict(chain(model.named_parameters(), model.named_buffers()))


def offload(model: object) -> dict[str, torch.Tensor]:
    """-> the host copies, by name; every device tensor of ``model`` left empty."""
    host = {}
    for name, tensor in _tensors(model).items():
        host[name] = tensor.data.to("cpu")
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return host


def restore(model: object, host: dict[str, torch.Tensor], device: torch.device) -> None:
    for name, tensor in _tensors(model).items():
        tensor.data = host[name].to(device)
