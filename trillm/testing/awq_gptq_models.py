"""Tiny AWQ / GPTQ checkpoints for tests, written from a tiny random float checkpoint.

``write_tiny_group_quantized(hf_dir, out_dir, method, group_size, sym)`` rounds every decoder
linear weight to 4-bit groups (round-to-nearest with a per-group scale and zero point: what AWQ
and GPTQ store, without their calibration), packs them in AutoAWQ's "gemm" / AutoGPTQ's layout
(written here as those projects document their packing loops: nibble by nibble, an independent
path from trillm's vectorised unpacker), and writes two folders: ``out_dir/quantized`` (the
checkpoint, other tensors fp16) and ``out_dir/dequantized`` (the same model with the weights
``(q - z) * s`` in fp32): the reference transformers runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(
    w: np.ndarray, group_size: int, sym: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, K] fp32 -> (q [N, K] 0..15, scales [N, G] fp16, zeros [N, G] 0..15)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    x = w.reshape(n, k // g, g)
    if sym:
        scale = np.abs(x).max(axis=2) * 2 / 15
        zero = np.full(scale.shape, 8.0)
    else:
        lo, hi = np.minimum(x.min(axis=2), 0), np.maximum(x.max(axis=2), 0)
        scale = (hi - lo) / 15
        zero = np.clip(np.round(-lo / np.where(scale > 0, scale, 1)), 0, 15)
    scale = np.where(scale > 0, scale, 1).astype(np.float16)
    s32 = scale.astype(np.float32)[:, :, None]
    q = np.clip(np.round(x / s32) + zero[:, :, None], 0, 15).astype(np.uint8).reshape(n, k)
    return q, scale, zero.astype(np.uint8)


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def pack_awq(values: np.ndarray) -> torch.Tensor:
    """[R, N] 0..15 (R = K inputs, or G groups) -> [R, N / 8] int32, AutoAWQ's order."""
    rows, n = values.shape
    words = np.zeros((rows, n // 8), dtype=np.uint64)
    for col in range(n // 8):
        for i in range(8):
            words[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint64) << (4 * i)
    return _to_int32(words)


def pack_gptq_rows(values: np.ndarray) -> torch.Tensor:
    """qweight: [K, N] 0..15 -> [K / 8, N] int32, eight consecutive inputs a word."""
    k, n = values.shape
    words = np.zeros((k // 8, n), dtype=np.uint64)
    for row in range(k // 8):
        for j in range(8):
            words[row] |= values[row * 8 + j].astype(np.uint64) << (4 * j)
    return _to_int32(words)


def pack_gptq_cols(values: np.ndarray) -> torch.Tensor:
    """qzeros: [G, N] 0..15 -> [G, N / 8] int32, eight consecutive outputs a word."""
    g, n = values.shape
    words = np.zeros((g, n // 8), dtype=np.uint64)
    for col in range(n // 8):
        for j in range(8):
            words[:, col] |= (values[:, col * 8 + j].astype(np.uint64) & 0xF) << (4 * j)
    return _to_int32(words)


def _packed(
    method: str, q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group_size: int
) -> dict[str, torch.Tensor]:
    if method == "awq":
        return {
            "qweight": pack_awq(q.T),
            "qzeros": pack_awq(zeros.T),
            "scales": torch.from_numpy(scales.T.copy()),
        }
    k = q.shape[1]
    g = k if group_size == -1 else group_size
    return {
        "qweight": pack_gptq_rows(q.T),
        "qzeros": pack_gptq_cols(zeros.T.astype(np.int64) - 1),
        "scales": torch.from_numpy(scales.T.copy()),
        "g_idx": torch.arange(k, dtype=torch.int32) // g,
    }


def write_tiny_group_quantized(
    hf_dir: str | Path, out_dir: str | Path, method: str, group_size: int, sym: bool = False
) -> tuple[Path, Path]:
    """-> (quantized folder, dequantized reference folder)."""
    from safetensors.torch import load_file, save_file

    hf_dir, out = Path(hf_dir), Path(out_dir)
    state = load_file(str(hf_dir / "model.safetensors"))
    quantized, reference = {}, {}
    for name, tensor in state.items():
        half = tensor.to(torch.float16)
        path, _, kind = name.rpartition(".")
        if kind != "weight" or path.rpartition(".")[2] not in QUANTIZED:
            quantized[name], reference[name] = half, half.to(torch.float32)
            continue
        q, scales, zeros = quantize_groups(half.float().numpy(), group_size, sym)
        for part, value in _packed(method, q, scales, zeros, group_size).items():
            quantized[f"{path}.{part}"] = value.contiguous()
        g = q.shape[1] // scales.shape[1]
        w = (q.astype(np.float32) - np.repeat(zeros, g, axis=1)) * np.repeat(
            scales.astype(np.float32), g, axis=1
        )
        reference[name] = torch.from_numpy(w)
    folders = (out / "quantized", out / "dequantized")
    for folder in folders:
        shutil.copytree(hf_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(quantized, str(folders[0] / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(folders[1] / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["torch_dtype"] = "float16"
    qc = {"quant_method": method, "bits": 4, "group_size": group_size}
    qc.update(
        {"version": "gemm", "zero_point": True}
        if method == "awq"
        else {"sym": sym, "desc_act": False, "checkpoint_format": "gptq"}
    )
    config["quantization_config"] = qc
    (folders[0] / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folders
