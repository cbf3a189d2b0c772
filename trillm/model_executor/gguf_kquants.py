"""GGML's K-quant types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), dequantized in torch.

Most GGUF files in use (``Q4_K_M``, ``Q5_K_M``, ``Q6_K``, ...) store their weights in these
types. trillm keeps their projections quantized (``kernels/linear_q_cpu.py`` repacks the blocks
for its kernel); this dequantizer (``gguf_loader.dequantized_tensor``) serves the rest: the
embedding's lookup table, ``dequantize_gguf``, a tensor-parallel split inside a block. Tests
check every type against the ``gguf`` package's dequantizer on random blocks (every bit pattern
is a valid block).

A super-block holds 256 values (``QK_K``) in sub-blocks of 16 or 32 values, each with its own
small integer scale (and minimum), which a per-super-block fp16 ``d`` (and ``dmin``) multiply.
Byte layouts (offsets within a block):

- Q2_K (84):  scales[16] (low 4 bits scale, high 4 bits min), qs[64] (2 bits), d, dmin.
- Q3_K (110): hmask[32] (the third bit), qs[64] (low 2 bits), scales[12] (16 x 6 bits, -32), d.
- Q4_K (144): d, dmin, scales[12] (8 x 6-bit scale and min), qs[128] (4 bits).
- Q5_K (176): d, dmin, scales[12] (as Q4_K), qh[32] (the fifth bit), qs[128] (low 4 bits).
- Q6_K (210): ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d.

Arithmetic as llama.cpp's reference dequantizer: fp32, ``(d * scale) * q - (dmin * min)``.
"""

from __future__ import annotations

import torch

QK_K = 256
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[nb, 2] uint8 -> [nb, 1] fp32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).float()


def _shifts(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _scale_min_6bit(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> (scales [nb, 8], mins [nb, 8]) as fp32.

    Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scale) and 4-7 (min). Sub-blocks 4-7: the low
    and high nibbles of bytes 8-11, with the top 2 bits of bytes 0-3 (scale) / 4-7 (min) above."""
    first, second, third = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([first & 63, (third & 0xF) | ((first >> 6) << 4)], dim=1)
    mins = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc, qs, d, dmin = b[:, 0:16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    # value i of a half (128 values) = 2-bit field (i // 32) of byte i % 32 of that half's qs
    q = (qs.view(nb, 2, 1, 32) >> _shifts([0, 2, 4, 6], b.device).view(1, 1, 4, 1)) & 3
    q = q.reshape(nb, 16, 16).float()  # [nb, sub-block, value]; sub-block = value index // 16
    dl = (d * (sc & 0xF).float()).unsqueeze(2)  # [nb, 16, 1]
    ml = (dmin * (sc >> 4).float()).unsqueeze(2)
    return (dl * q - ml).reshape(nb, QK_K)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales [nb, 16]: scale i's low 4 bits are the low (i < 8) or
    high (i >= 8) nibble of byte i % 8, its high 2 bits are bits 2 * (i // 4) of byte 8 + i % 4."""
    low = torch.cat([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], dim=1)  # [nb, 16]
    high_src = s[:, 8:12].repeat(1, 4)  # [nb, 16]: byte 8 + i % 4
    shifts = _shifts([2 * (i // 4) for i in range(16)], s.device)
    high = (high_src >> shifts) & 3
    return (low | (high << 4)).float() - 32.0


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    hmask, qs, d = b[:, 0:32], b[:, 32:96], _f16(b[:, 108:110])
    scales = _q3_k_scales(b[:, 96:108])
    low = (qs.view(nb, 2, 1, 32) >> _shifts([0, 2, 4, 6], b.device).view(1, 1, 4, 1)) & 3
    # value 128 n + 32 j + l takes bit 4 n + j of hmask[l]; a clear bit subtracts 4
    bit = (hmask.view(nb, 1, 1, 32) >> _shifts(list(range(8)), b.device).view(1, 2, 4, 1)) & 1
    q = low.to(torch.int16) - 4 * (1 - bit.to(torch.int16))  # [nb, 2, 4, 32]
    dl = (d * scales).unsqueeze(2)  # [nb, 16, 1]
    return (dl * q.reshape(nb, 16, 16).float()).reshape(nb, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_6bit(b[:, 4:16])
    qs = b[:, 16:144].view(nb, 4, 1, 32)
    # chunk c of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
    q = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(nb, 8, 32).float()
    return ((d * sc).unsqueeze(2) * q - (dmin * mn).unsqueeze(2)).reshape(nb, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_6bit(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:176].view(nb, 4, 1, 32)
    low = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(nb, 8, 32)
    # sub-block j's fifth bit is bit j of qh[l]
    high = (qh.view(nb, 1, 32) >> _shifts(list(range(8)), b.device).view(1, 8, 1)) & 1
    q = (low | (high << 4)).float()
    return ((d * sc).unsqueeze(2) * q - (dmin * mn).unsqueeze(2)).reshape(nb, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql, qh = b[:, 0:128].view(nb, 2, 1, 2, 32), b[:, 128:192].view(nb, 2, 1, 32)
    sc, d = b[:, 192:208].contiguous().view(torch.int8).float(), _f16(b[:, 208:210])
    # half n, group g (of 32): the low nibble (g < 2) or high nibble (g >= 2) of ql byte
    # 64 n + 32 (g % 2) + l, and 2-bit field g of qh byte 32 n + l
    low = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(nb, 2, 4, 32)
    high = (qh >> _shifts([0, 2, 4, 6], b.device).view(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).to(torch.int16) - 32  # [nb, 2, 4, 32]
    dl = (d * sc).unsqueeze(2)  # [nb, 16, 1]: one scale per 16 values
    return (dl * q.reshape(nb, 16, 16).float()).reshape(nb, QK_K)


_DEQUANTIZE = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """raw: uint8 [..., bytes] of whole blocks of ``type_name`` -> fp32 [n_values] (flat, in
    the order of the blocks)."""
    if type_name not in _DEQUANTIZE:
        raise ValueError(f"{type_name} is not a K-quant type ({', '.join(BLOCK_BYTES)}).")
    size = BLOCK_BYTES[type_name]
    flat = raw.reshape(-1)
    if raw.dtype != torch.uint8 or flat.numel() % size:
        raise ValueError(f"{type_name} data must be uint8 whole blocks of {size} bytes.")
    return _DEQUANTIZE[type_name](flat.view(-1, size)).reshape(-1)
