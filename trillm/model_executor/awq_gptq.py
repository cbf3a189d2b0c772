"""AWQ and GPTQ 4-bit checkpoints: their ``quantization_config`` and packed tensors (issue 13).

Both store, per quantized linear layer ``P`` of a [N, K] weight (N outputs, K inputs) cut into
G = K / g groups of g inputs, values ``w = (q - z) * s`` with 4-bit q and z, fp16 s:

- AWQ ("gemm" version, AutoAWQ): ``P.qweight`` [K, N / 8] int32, ``P.qzeros`` [G, N / 8] int32,
  ``P.scales`` [G, N] fp16. Eight outputs share an int32; nibble i (bits 4i..4i+3) of word c
  holds output 8c + AWQ_ORDER[i], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7). Zero points as they are.
- GPTQ (AutoGPTQ): ``P.qweight`` [K / 8, N] int32 packed along K (nibble i of row r is input
  8r + i), ``P.qzeros`` [G, N / 8] int32 packed along N (nibble i of word c is output 8c + i),
  ``P.scales`` [G, N] fp16, ``P.g_idx`` [K] the group of each input. ``checkpoint_format``
  "gptq" (v1, the default) stores z - 1, "gptq_v2" z itself.

``unpack_awq`` / ``unpack_gptq`` give (q [N, K], scales [N, G], zeros [N, G]) for
``linear_q_cpu.QuantizedWeight.from_groups``. What the kernel cannot run is refused by name
before anything loads (``parse_config``): bits other than 4, act-order (``desc_act``), group
sizes that are not a multiple of 32, other AWQ versions and GPTQ formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trillm.errors import UnsupportedQuantizationError

METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output AWQ_ORDER[i]
PACKED = ("qweight", "qzeros", "scales", "g_idx")  # a quantized layer's tensors (name suffixes)
_BLOCK = 32  # the kernel's block along K: a group size must be a multiple of it


@dataclass(frozen=True)
class GroupQuantConfig:
    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group over all of K
    zero_minus_one: bool  # GPTQ v1: qzeros hold z - 1


def parse_config(hf: dict[str, Any]) -> GroupQuantConfig:
    """config.json's ``quantization_config`` for an AWQ / GPTQ checkpoint trillm runs, else
    ``UnsupportedQuantizationError`` naming what it cannot."""
    qc = hf.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise UnsupportedQuantizationError(f"not an AWQ / GPTQ checkpoint: {method!r}")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise UnsupportedQuantizationError(
            f"{method} checkpoint with bits={bits!r}: trillm runs 4-bit AWQ / GPTQ only."
        )
    group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if group != -1 and (group <= 0 or group % _BLOCK):
        raise UnsupportedQuantizationError(
            f"{method} checkpoint with group_size={group}: trillm runs group sizes that are a "
            f"multiple of {_BLOCK} (or -1)."
        )
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantizationError(
                f"AWQ version {version!r}: trillm reads AutoAWQ's 'gemm' layout only."
            )
        if qc.get("zero_point", True) is False:
            raise UnsupportedQuantizationError("AWQ with zero_point=false is not supported.")
        return GroupQuantConfig(method, group, zero_minus_one=False)
    if qc.get("desc_act"):
        raise UnsupportedQuantizationError(
            "GPTQ checkpoint with desc_act=true (act-order): not supported; trillm runs "
            "desc_act=false checkpoints."
        )
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantizationError(
            f"GPTQ checkpoint_format {fmt!r}: trillm reads 'gptq' and 'gptq_v2'."
        )
    return GroupQuantConfig(method, group, zero_minus_one=fmt == "gptq")


def shape_of(method: str, qweight: torch.Tensor) -> tuple[int, int]:
    """The [N, K] of the weight a ``qweight`` packs."""
    rows, cols = qweight.shape
    return (cols * 8, rows) if method == "awq" else (cols, rows * 8)


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word (bits 4i..4i+3)."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    shifts = 4 * np.arange(8, dtype=np.int64)
    return ((u[..., None] >> shifts) & 0xF).astype(np.uint8)


def _awq_columns(words: np.ndarray) -> np.ndarray:
    """AWQ words [R, N / 8] -> values [R, N] in output order."""
    nib = _nibbles(words)  # [R, W, 8] nibble order
    out = np.empty_like(nib)
    out[:, :, list(AWQ_ORDER)] = nib  # output AWQ_ORDER[i] is nibble i
    return out.reshape(words.shape[0], -1)


def _check_groups(cfg: GroupQuantConfig, name: str, k: int, groups: int) -> None:
    size = k if cfg.group_size == -1 else cfg.group_size
    if k % size or k // size != groups:
        raise UnsupportedQuantizationError(
            f"{name}: {groups} groups of scales for K={k} and group_size={cfg.group_size}."
        )


def unpack(
    cfg: GroupQuantConfig, name: str, tensors: dict[str, torch.Tensor]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A layer's packed tensors -> (q [N, K] uint8, scales [N, G] fp16, zeros [N, G] uint8)."""
    missing = [t for t in ("qweight", "qzeros", "scales") if t not in tensors]
    if missing:
        raise UnsupportedQuantizationError(f"{name}: the checkpoint lacks {', '.join(missing)}.")
    qweight = tensors["qweight"].numpy()
    qzeros = tensors["qzeros"].numpy()
    scales = tensors["scales"].to(torch.float32).numpy()
    if cfg.method == "awq":
        q = _awq_columns(qweight).T  # [N, K]
        zeros = _awq_columns(qzeros).T  # [N, G]
    else:
        q = _nibbles(qweight.T).reshape(qweight.shape[1], -1)  # [N, K]: row r nibble i = 8r + i
        zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1).T  # [N, G]
        if cfg.zero_minus_one:
            zeros = zeros + 1  # v1 stores z - 1 (15 reads as 16, as GPTQ's kernels read it)
    n, k = q.shape
    groups = scales.shape[0]
    _check_groups(cfg, name, k, groups)
    if scales.shape[1] != n or zeros.shape != (n, groups):
        raise UnsupportedQuantizationError(f"{name}: scales / qzeros do not match qweight.")
    if "g_idx" in tensors:  # desc_act=false: input i is in group i // g
        expected = np.arange(k) // (k // groups)
        if not np.array_equal(tensors["g_idx"].numpy(), expected):
            raise UnsupportedQuantizationError(
                f"{name}: g_idx reorders the inputs (act-order), which trillm does not run."
            )
    half = scales.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), scales):
        raise UnsupportedQuantizationError(f"{name}: scales are not exact in fp16.")
    return np.ascontiguousarray(q), np.ascontiguousarray(half.T), np.ascontiguousarray(zeros)
