"""Linear layers whose weights stay GGUF-quantized (Q4_0 / Q4_1 / Q8_0) on CPU.

``load_gguf(model, cfg)`` streams a GGUF file into a model built by ``loader.build_model``.
Float tensors load as usual; a quantized projection's GGML blocks (the stacked q/k/v and
gate/up concatenated by rows, in shard order) are repacked once into a
``linear_q_cpu.QuantizedWeight`` and the layer multiplies by it (``kernels/linear_q_cpu.py``:
the native kernel, or dequantize-then-``F.linear`` without it); its float weight is dropped, so
the model's linear weights take their quantized size in memory. The embedding is looked up, so
it is loaded dequantized; a tied ``lm_head`` multiplies by the embedding's quantized blocks, as
llama.cpp does. A stacked layer whose shards come in different GGML types is loaded
dequantized (the kernel takes one type per layer). ``cfg.quantization`` None (``dequantize_gguf``)
loads every quantized tensor dequantized to the run's dtype.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trillm.config import ModelConfig
from trillm.kernels import linear_q_cpu
from trillm.model_executor import gguf_loader
from trillm.model_executor.gguf_loader import GGUFTensor

EMBEDDING = "model.embed_tokens.weight"
_QTYPE_IDS = {"Q4_0": linear_q_cpu.Q4_0, "Q4_1": linear_q_cpu.Q4_1, "Q8_0": linear_q_cpu.Q8_0}


def _quantized_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight: linear_q_cpu.QuantizedWeight = self.quantized_weight  # type: ignore[assignment]
    bias: torch.Tensor | None = self.quantized_bias  # type: ignore[assignment]
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        return linear_q_cpu.linear(x, weight, bias)
    w = linear_q_cpu.dequantize(weight, x.dtype).to(x.device)  # [N, K]
    return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def quantize_module(module: nn.Linear, weight: linear_q_cpu.QuantizedWeight) -> None:
    """Make ``module`` multiply by ``weight``; its float weight is dropped (unless shared with
    the embedding, which still needs it)."""
    module.quantized_weight = weight
    bias = module.bias
    module.quantized_bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    module.forward = types.MethodType(_quantized_forward, module)  # type: ignore[method-assign]


def load_gguf(model: nn.Module, cfg: ModelConfig) -> None:
    """Load ``cfg.model`` (a GGUF file) into ``model``; keep Q4/Q8 projections quantized
    when ``cfg.quantization == "gguf"``."""
    file = gguf_loader.GGUFFile(cfg.model)
    keep = cfg.quantization == "gguf"
    quantized: dict[str, GGUFTensor] = {}
    model.load_weights(_weights(file, keep, cfg.tie_word_embeddings, quantized))  # type: ignore[operator]
    if keep:
        _attach(model, quantized)


def _weights(
    file: gguf_loader.GGUFFile, keep: bool, tied: bool, quantized: dict[str, GGUFTensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    for t in file.tensors():
        if t.type_name in gguf_loader.FLOAT_TYPES:
            yield t.name, gguf_loader.float_tensor(t)
        elif not keep or t.name == EMBEDDING:
            if keep and tied:
                quantized["lm_head.weight"] = t  # the head multiplies by the blocks
            yield t.name, gguf_loader.dequantized_tensor(t)
        else:
            quantized[t.name] = t
            yield t.name, torch.zeros((), dtype=torch.float32).expand(t.shape)  # set below


def _attach(model: nn.Module, quantized: dict[str, GGUFTensor]) -> None:
    from trillm.model_executor.models.llama import STACKED_PARAMS, StackedLinear

    groups: dict[str, dict[str, GGUFTensor]] = {}  # module path -> shard (or "") -> tensor
    for name, t in quantized.items():
        path = name.removesuffix(".weight")
        parent, _, proj = path.rpartition(".")
        if proj in STACKED_PARAMS:
            stacked, shard = STACKED_PARAMS[proj]
            groups.setdefault(f"{parent}.{stacked}", {})[shard] = t
        else:
            groups.setdefault(path, {})[""] = t
    for path, shards in groups.items():
        module = model.get_submodule(path)
        assert isinstance(module, nn.Linear)
        if isinstance(module, StackedLinear):
            parts = [shards[s] for s in module.shard_offsets]  # every shard: all were quantized
        else:
            parts = [shards[""]]
        kinds = {t.type_name for t in parts}
        if len(kinds) > 1:  # one kernel call takes one type: this layer runs dequantized
            for shard, t in shards.items():
                assert isinstance(module, StackedLinear)
                module.load_shard(shard, "weight", gguf_loader.dequantized_tensor(t))
            continue
        raw = np.concatenate([np.asarray(t.data) for t in parts], axis=0)  # [N, bytes]
        weight = linear_q_cpu.QuantizedWeight(
            raw, _QTYPE_IDS[parts[0].type_name], module.out_features, module.in_features
        )
        quantize_module(module, weight)
        if (
            path != "lm_head"
            or module.weight is not model.get_submodule("model.embed_tokens").weight
        ):
            module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype),
                                         requires_grad=False)  # fmt: skip
