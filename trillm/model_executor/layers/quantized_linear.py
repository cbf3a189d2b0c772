"""Linear layers whose weights stay quantized on CPU: GGUF's Q4_0 / Q4_1 / Q8_0 and K-quants
(Q2_K .. Q6_K), AWQ / GPTQ 4-bit groups.

``load_gguf(model, cfg)`` streams a GGUF file into a model built by ``loader.build_model``.
Float tensors load as usual; a quantized projection's GGML blocks (the stacked q/k/v and
gate/up concatenated by rows, in shard order) are repacked once into a
``linear_q_cpu.QuantizedWeight`` and the layer multiplies by it (``kernels/linear_q_cpu.py``:
the native kernel, or dequantize-then-``F.linear`` without it); its float weight is dropped, so
the model's linear weights take their quantized size in memory. The embedding is looked up, so
it is loaded dequantized; a tied ``lm_head`` multiplies by the embedding's quantized blocks, as
llama.cpp does. A stacked layer whose shards come in different kept types (llama.cpp's mixed
formats: ``Q4_K_M`` stores q/k in Q4_K and v in Q6_K, ``Q3_K_M`` mixes Q3_K / Q4_K / Q5_K)
keeps each in its own type (``linear_q_cpu.StackedQuantizedWeight``: one kernel call per part,
each writing its columns of the output); one whose shards include a float tensor (F16 beside
Q8_0) loads dequantized, with a warning naming the layer. ``cfg.quantization`` None (``dequantize_gguf``)
loads every quantized tensor dequantized to the run's dtype. Under tensor parallelism each
rank loads its rows / whole blocks of each tensor (``quant_sharding.gguf_shard``).

``load_group_quantized(model, weights, cfg)`` loads an AWQ / GPTQ checkpoint the same way: each
layer's qweight / qzeros / scales (``model_executor/awq_gptq.py``) become one Q4_G
``QuantizedWeight`` (stacked shards concatenated by rows); layers the checkpoint keeps in float
(the embedding, usually ``lm_head``) load as usual. Under tensor parallelism ``weights``
holds this rank's words and groups (``quant_sharding.read_packed_shard``).

A quantized layer called with at least ``linear_q_cpu.INT8_MIN_ROWS`` rows (prefill, batched
decode) rounds its activations to int8 and runs the VNNI kernel, where that is faster.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trillm.config import ModelConfig
from trillm.distributed.sharding import RankShapes
from trillm.kernels import linear_q_cpu
from trillm.model_executor import awq_gptq, gguf_loader, quant_sharding
from trillm.model_executor.gguf_loader import GGUFTensor
from trillm.model_executor.models.stacked_weights import STACKED_PARAMS, StackedLinear

logger = logging.getLogger(__name__)
EMBEDDING = "model.embed_tokens.weight"
_T = TypeVar("_T")
# GGML type name -> id (trillm's own kernel types, Q4_G, Q5_KM and Q4_KM, are not file types)
_QTYPE_IDS = {name: q for q, name in linear_q_cpu.QTYPE_NAMES.items() if q < linear_q_cpu.Q4_G}


def _quantized_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight: linear_q_cpu.AnyQuantizedWeight = self.quantized_weight  # type: ignore[assignment]
    bias: torch.Tensor | None = self.quantized_bias  # type: ignore[assignment]
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        int8 = linear_q_cpu.use_int8(weight, x.numel() // max(x.shape[-1], 1))
        if x.dtype == torch.float16:  # the kernels take fp32 or bf16: widened, exact
            return linear_q_cpu.linear(x.float(), weight, bias, int8_activations=int8).half()
        return linear_q_cpu.linear(x, weight, bias, int8_activations=int8)
    w = linear_q_cpu.dequantize(weight, x.dtype).to(x.device)  # [N, K]
    return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def quantize_module(module: nn.Linear, weight: linear_q_cpu.AnyQuantizedWeight) -> None:
    """Make ``module`` multiply by ``weight``; its float weight is dropped (unless shared with
    the embedding, which still needs it)."""
    module.quantized_weight = weight  # type: ignore[assignment]
    bias = module.bias
    module.quantized_bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    module.forward = types.MethodType(_quantized_forward, module)  # type: ignore[method-assign]


def load_gguf(
    model: nn.Module,
    cfg: ModelConfig,
    wanted: Callable[[str], bool] | None = None,
    shard: tuple[ModelConfig, RankShapes] | None = None,
) -> None:
    """Load ``cfg.model`` (a GGUF file) into ``model``; keep its quantized projections so
    when ``cfg.quantization == "gguf"``. ``wanted``: the names a pipeline stage reads;
    ``shard``: this tensor-parallel rank's shapes (``quant_sharding.gguf_shard``)."""
    from trillm.distributed.pipeline import is_missing

    file = gguf_loader.GGUFFile(cfg.model)
    keep = cfg.quantization == "gguf"
    quantized: dict[str, GGUFTensor] = {}
    # another pipeline stage's tensors are never read, dequantized or sliced
    tensors = (t for t in file.tensors() if wanted is None or wanted(t.name))
    sliced = tensors if shard is None else _rank_tensors(tensors, *shard)
    weights = _weights(sliced, keep, cfg.tie_word_embeddings, quantized)
    model.load_weights(weights)  # type: ignore[operator]
    if keep:  # NOTE: a stage with the tied embedding but not the head skips the head's blocks
        _attach(model, {name: t for name, t in quantized.items() if not is_missing(model, name)})


def _rank_tensors(
    tensors: Iterator[GGUFTensor], cfg: ModelConfig, shapes: RankShapes
) -> Iterator[GGUFTensor | tuple[str, torch.Tensor]]:
    """A tensor-parallel rank's part of each tensor: its rows / whole blocks of a quantized
    one, else (name, its slice in floats): a float tensor, or a quantized one split inside its
    blocks (dequantized, with a warning naming it)."""
    for t in tensors:
        if t.type_name in gguf_loader.FLOAT_TYPES:
            yield t.name, shapes.read_shard(cfg, t.name, gguf_loader.float_tensor(t))
            continue
        part = quant_sharding.gguf_shard(cfg, shapes, t)
        if part is not None:
            yield part
            continue
        if cfg.quantization == "gguf" and t.type_name in gguf_loader.QUANTIZED_TYPES:
            logger.warning(
                "GGUF tensor %s (%s, K=%d) does not split over "
                "tensor_parallel_size=%d on its blocks; this rank's part runs "
                "dequantized in the run's dtype",
                t.name,
                t.type_name,
                t.shape[1],
                shapes.size,
            )
        yield t.name, quant_sharding.gguf_dequantized_columns(cfg, shapes, t)


def _weights(
    tensors: Iterator[GGUFTensor | tuple[str, torch.Tensor]],
    keep: bool,
    tied: bool,
    quantized: dict[str, GGUFTensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    for t in tensors:
        if isinstance(t, tuple):  # already floats (a tensor-parallel rank's slice)
            yield t
            continue
        if t.type_name in gguf_loader.FLOAT_TYPES:
            yield t.name, gguf_loader.float_tensor(t)
        elif not keep or t.name == EMBEDDING or t.type_name not in gguf_loader.QUANTIZED_TYPES:
            if keep and tied and t.name == EMBEDDING and t.type_name in gguf_loader.QUANTIZED_TYPES:
                quantized["lm_head.weight"] = t  # the head multiplies by the blocks
            yield t.name, gguf_loader.dequantized_tensor(t)  # K-quants: always
        else:
            quantized[t.name] = t
            yield t.name, torch.zeros((), dtype=torch.float32).expand(t.shape)  # set below


def _by_module(
    model: nn.Module, paths: dict[str, _T]
) -> Iterator[tuple[nn.Linear, str, list[_T], dict[str, _T]]]:
    """Checkpoint layer path -> item, regrouped by the model's linear modules: (module, its
    path, its items in shard order (the shards that have one), items by shard ("" for a plain
    layer))."""
    groups: dict[str, dict[str, _T]] = {}  # module path -> shard (or "") -> item
    for path, item in paths.items():
        parent, _, proj = path.rpartition(".")
        if proj in STACKED_PARAMS:
            stacked, shard = STACKED_PARAMS[proj]
            groups.setdefault(f"{parent}.{stacked}", {})[shard] = item
        else:
            groups.setdefault(path, {})[""] = item
    for path, shards in groups.items():
        module = model.get_submodule(path)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"quantized checkpoint tensor for {path!r}, not a linear layer")
        if isinstance(module, StackedLinear):
            parts = [shards[s] for s in module.shard_offsets if s in shards]
        else:
            parts = [shards[""]]
        yield module, path, parts, shards


def _drop_float_weight(model: nn.Module, module: nn.Linear, path: str) -> None:
    # NOTE: getattr: a pipeline stage without the embedding holds a PPMissingLayer there.
    embedding = getattr(model.get_submodule("model.embed_tokens"), "weight", None)
    if path != "lm_head" or module.weight is not embedding:
        module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)


def _attach(model: nn.Module, quantized: dict[str, GGUFTensor]) -> None:
    paths = {name.removesuffix(".weight"): t for name, t in quantized.items()}
    for module, path, parts, shards in _by_module(model, paths):
        # a shard stored as floats (F16 beside Q8_0) was loaded as floats: the layer is not all
        # blocks, so its kept shards are dequantized beside it
        if len(parts) != len(getattr(module, "shard_offsets", [""])):
            assert isinstance(module, StackedLinear)
            logger.warning(
                "GGUF layer %s mixes kept and dequantized tensor types; it runs dequantized in %s",
                path,
                module.weight.dtype,
            )
            for shard, t in shards.items():
                module.load_shard(shard, "weight", gguf_loader.dequantized_tensor(t))
            continue
        quantize_module(module, gguf_weight(parts, module.in_features))
        _drop_float_weight(model, module, path)


def gguf_weight(parts: list[GGUFTensor], k: int) -> linear_q_cpu.AnyQuantizedWeight:
    """The blocks of a layer's shards (in shard order): one weight when they share a type,
    else one per run of shards of the same type (q and k Q4_K, v Q6_K: two parts)."""
    runs: list[list[GGUFTensor]] = []
    for t in parts:
        if runs and runs[-1][0].type_name == t.type_name:
            runs[-1].append(t)
        else:
            runs.append([t])
    weights = []
    for run in runs:
        raw = np.concatenate([np.asarray(t.data) for t in run], axis=0)  # [n, bytes]
        n = sum(t.shape[0] for t in run)
        weights.append(linear_q_cpu.QuantizedWeight(raw, _QTYPE_IDS[run[0].type_name], n, k))
    return weights[0] if len(weights) == 1 else linear_q_cpu.StackedQuantizedWeight(weights)


def load_group_quantized(
    model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> None:
    """Load an AWQ / GPTQ checkpoint (``weights``: its tensors) into ``model``; its 4-bit
    layers stay quantized (Q4_G), the rest load as usual."""
    qcfg = awq_gptq.parse_config(cfg.hf_config)
    packed: dict[str, dict[str, torch.Tensor]] = {}  # layer path -> qweight / qzeros / ...

    def floats() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            path, _, kind = name.rpartition(".")
            if kind not in awq_gptq.PACKED:
                yield name, tensor
                continue
            packed.setdefault(path, {})[kind] = tensor
            if kind == "qweight":  # the float weight's place, filled by the quantized one
                shape = awq_gptq.shape_of(qcfg.method, tensor)
                yield f"{path}.weight", torch.zeros((), dtype=torch.float32).expand(shape)

    model.load_weights(floats())  # type: ignore[operator]
    for module, path, parts, _ in _by_module(model, packed):
        groups = [awq_gptq.unpack(qcfg, path, tensors) for tensors in parts]
        q, scales, zeros = (np.concatenate(arrays, axis=0) for arrays in zip(*groups, strict=True))
        if q.shape != (module.out_features, module.in_features):
            raise ValueError(
                f"{path}: quantized weight {q.shape} for a layer of "
                f"{(module.out_features, module.in_features)}"
            )
        quantize_module(module, linear_q_cpu.QuantizedWeight.from_groups(q, scales, zeros))
        _drop_float_weight(model, module, path)
