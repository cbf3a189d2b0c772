"""Tensor parallelism over quantized checkpoints (issues 13 and 14): a rank's slice of AWQ /
GPTQ packed tensors and of GGUF block rows, read without the rest of the tensor.

A rank's share of a layer's [N, K] weight is ``RankShapes``'s: rows of N for the
column-parallel layers (q/k/v, gate/up; a fused checkpoint weight's rows part by part; the
head's vocabulary rows), columns of K for the row-parallel ones (o, down). In the packed
layouts (``awq_gptq.py``, G groups of g inputs):

- AWQ: qweight [K, N/8], qzeros [G, N/8], scales [G, N]. A split of N takes whole int32 words
  (its start and length multiples of 8); a split of K takes qweight rows and whole groups.
- GPTQ: qweight [K/8, N], qzeros [G, N/8], scales [G, N], g_idx [K]. A split of N takes
  qzeros words (multiples of 8); a split of K whole groups, g_idx counted from the shard's
  first group. (Act-order checkpoints are refused whatever the parallelism: ``parse_config``.)
- GGUF: rows [N, bytes] of blocks along K (32 values; 256 for the K-quants). A split of N
  takes rows (the head's last shard padded with all-zero blocks, which are zeros in every
  type); a split of K whole blocks. A split of K inside a block (hidden 576 over 2 ranks in
  256-value blocks) is not refused: ``gguf_shard`` returns None and the loader dequantizes
  the blocks covering the rank's columns (``gguf_dequantized_columns``) and loads them in the
  run's dtype, with a warning naming the tensor.

An AWQ / GPTQ split off a word or group boundary is refused before anything loads
(``check_group_quant_split``), naming the layer, its sizes and tensor_parallel_size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trillm.config import ModelConfig
from trillm.distributed.sharding import RankShapes, TensorParallelConfigError
from trillm.model_executor import awq_gptq, gguf_loader
from trillm.model_executor.gguf_loader import GGUFTensor
from trillm.utils import cdiv

_PACK = 8  # int4 values per int32 word
_KERNEL_BLOCK = 32  # the Q4_G kernel's block along K: a rank's K must be whole blocks
# layer -> its path in a decoder layer (the name its split is computed from)
_LAYERS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
_FUSED = ("qkv_proj", "gate_up_proj")


def _ranges(shapes: RankShapes, cfg: ModelConfig, name: str) -> tuple[int, list[tuple[int, int]]]:
    """(dim of the [N, K] weight split: 0 outputs, 1 inputs, -1 none, ranges) of ``name``'s
    layer on this rank; a fused layer has one range of N per part."""
    path = name.rpartition(".")[0]
    proj = path.rpartition(".")[2]
    if proj in _FUSED:
        return 0, shapes.fused_rows(cfg, proj)
    split = shapes.split_of(cfg, f"{path}.weight")
    if split is None:
        return -1, []
    dim, start, length = split
    return dim, [(start, length)]


def _misaligned(group_size: int, dim: int, ranges: list[tuple[int, int]]) -> str | None:
    """Why these ranges do not fall on the packed layout's boundaries (None: they do)."""
    for start, length in ranges:
        if dim == 0 and (start % _PACK or length % _PACK):
            return (
                f"{length} outputs per rank from output {start}, not whole int32 words of "
                f"{_PACK} 4-bit values"
            )
        if dim == 1 and group_size != -1 and (start % group_size or length % group_size):
            return (
                f"{length} inputs per rank from input {start}, not whole groups of "
                f"group_size={group_size}"
            )
        if dim == 1 and length % _KERNEL_BLOCK:
            return f"{length} inputs per rank, not a multiple of {_KERNEL_BLOCK}"
    return None


def check_group_quant_split(cfg: ModelConfig, size: int) -> None:
    """Refuse (TensorParallelConfigError) an AWQ / GPTQ model whose layers do not split over
    ``size`` ranks on the packed words and groups, naming the layer, sizes and the size."""
    if size == 1:
        return
    qcfg = awq_gptq.parse_config(cfg.hf_config)
    for rank in range(size):
        shapes = RankShapes.of(cfg, rank, size)
        for layer, path in _LAYERS.items():
            name = f"model.layers.0.{path}.qweight"
            dim, ranges = _ranges(shapes, cfg, name)
            why = _misaligned(qcfg.group_size, dim, ranges)
            if why is not None:
                n, k = _layer_shape(cfg, layer)
                kind = "column" if dim == 0 else "row"
                raise TensorParallelConfigError(
                    f"tensor_parallel_size={size}: the {qcfg.method.upper()} layer {layer} "
                    f"(N={n} outputs, K={k} inputs; {kind}-parallel) does not split on its "
                    f"packed layout: {why}. Choose a tensor_parallel_size that does."
                )


def _layer_shape(cfg: ModelConfig, layer: str) -> tuple[int, int]:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }[layer]


def read_packed_shard(cfg: ModelConfig, shapes: RankShapes, name: str, source: Any) -> torch.Tensor:
    """This rank's part of AWQ / GPTQ tensor ``name`` (``*.qweight``, ``qzeros``, ``scales``,
    ``g_idx``) from ``source`` (a safetensors slice or a tensor): only those rows/columns."""
    qcfg = awq_gptq.parse_config(cfg.hf_config)
    kind = name.rpartition(".")[2]
    dim, ranges = _ranges(shapes, cfg, name)
    whole = source if isinstance(source, torch.Tensor) else None
    if dim == -1:
        return whole if whole is not None else source[:]
    why = _misaligned(qcfg.group_size, dim, ranges)
    if why is not None or (dim == 0 and name.startswith("lm_head.")):
        raise TensorParallelConfigError(
            f"tensor_parallel_size={shapes.size}: {name} does not split on its packed layout"
            f"{': ' + why if why else ' (a quantized vocabulary-parallel head)'}."
        )
    if dim == 0:  # outputs: columns of every tensor but g_idx (inputs), whole words
        if kind == "g_idx":
            return whole if whole is not None else source[:]
        per_word = kind == "qzeros" or (kind == "qweight" and qcfg.method == "awq")
        unit = _PACK if per_word else 1
        return torch.cat(
            [source[:, start // unit : (start + length) // unit] for start, length in ranges], dim=1
        )
    (start, length), g = ranges[0], qcfg.group_size
    if kind == "qweight":  # inputs: AWQ's rows, GPTQ's words of 8 rows
        unit = 1 if qcfg.method == "awq" else _PACK
        return source[start // unit : (start + length) // unit]
    if kind == "g_idx":  # each input's group, counted from the shard's first group
        part = source[start : start + length]
        return part - start // g if g != -1 else part
    if g == -1:  # one group over all of K: every rank's inputs use its scale and zero
        return whole if whole is not None else source[:]
    return source[start // g : (start + length) // g]


def gguf_shard(cfg: ModelConfig, shapes: RankShapes, t: GGUFTensor) -> GGUFTensor | None:
    """This rank's rows / whole blocks of quantized GGUF tensor ``t`` (its data a view of the
    file where it can be), or None where a split of K falls inside a block."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    dim, ranges = _ranges(shapes, cfg, t.name)
    if dim == -1:
        return t
    n, k = t.shape
    if dim == 1:
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[t.type_name]]
        ((start, length),) = ranges
        if start % block or length % block:
            return None
        data = t.data[:, start // block * nbytes : (start + length) // block * nbytes]
        return GGUFTensor(t.name, t.type_name, (n, length), data)
    rows = np.concatenate([t.data[start : start + length] for start, length in ranges])
    if t.name.rpartition(".")[0] in ("model.embed_tokens", "lm_head"):
        pad = shapes.vocab_per_rank - rows.shape[0]  # the last rank's padding rows
        rows = np.concatenate([rows, np.zeros((pad, rows.shape[1]), dtype=rows.dtype)])
    return GGUFTensor(t.name, t.type_name, (rows.shape[0], k), rows)


def gguf_dequantized_columns(cfg: ModelConfig, shapes: RankShapes, t: GGUFTensor) -> torch.Tensor:
    """A split of K inside ``t``'s blocks: the blocks covering this rank's inputs dequantized
    to fp32, then its columns (never the whole tensor)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[t.type_name]]
    _, [(start, length)] = _ranges(shapes, cfg, t.name)
    first, end = start // block, cdiv(start + length, block)
    covering = GGUFTensor(
        t.name,
        t.type_name,
        (t.shape[0], (end - first) * block),
        t.data[:, first * nbytes : end * nbytes],
    )
    offset = start - first * block
    return gguf_loader.dequantized_tensor(covering)[:, offset : offset + length].contiguous()
