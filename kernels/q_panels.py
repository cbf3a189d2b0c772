"""The packed layout of ``ext/cpu_gemm_q.cpp`` (the comment there): a quantized weight's
values and per-block parameters cut into panels of ``PANEL`` output columns, one record per
(panel, block of 32 k). ``pack`` writes it from unpacked GGML blocks (``ggml_blocks``),
``unpack`` reads the values back (the reference the kernel is tested against); ``linear_q_cpu``
keeps a weight in it and multiplies by it.
"""

from __future__ import annotations

import numpy as np
import torch

from trillm.utils import cdiv

from .ggml_blocks import BLOCK, Q4_0, Q4_1, Q4_G, Q4_K, Q4_KM, Q5_KM, Q6_K, Q6_KP, Q8_0, QK_K

PANEL = 16  # output columns per panel of the packed layout
_HALF_MIN = (Q5_KM, Q4_KM)  # a scale and minimum per half block
_HIGH_BYTES = 2 * BLOCK  # Q5_KM: a uint64 mask of the fifth bits per quad of k


def _byte_values(qtype: int) -> bool:
    """Whether ``qtype``'s values are packed a signed byte each (else as nibble pairs)."""
    return qtype in (Q8_0, Q6_K)


def _values_bytes(qtype: int) -> int:
    if _byte_values(qtype):
        return PANEL * BLOCK
    return PANEL * BLOCK // 2 + (_HIGH_BYTES if qtype == Q5_KM else 0)


# Q6_KP (ext/cpu_gemm_q_q6.h): per panel and super-block of 256 k, d[16] fp16, then 8 blocks of
# nibbles (Q4's layout, of u = q + 32), highs (2 x 16 uint32 lanes: the top two bits of u[c][k],
# k = 16 h + 8 g + 4 e + s, at bit 4, 8, 12, 0 (s) + 2 g + 16 e of lane c of vector h) and
# sc[2][16] int8: 3,360 bytes, 420 a block of 32.
_Q6_BLOCK_BYTES = PANEL * BLOCK // 2 + PANEL * BLOCK // 4 + 2 * PANEL  # 416
_Q6_SUPER = QK_K // BLOCK  # blocks a super-block
_Q6_SHIFTS = (  # [g, e, s] -> the bit of lane c that holds u's top two bits
    np.array([4, 8, 12, 0]).reshape(1, 1, 4)
    + 2 * np.arange(2).reshape(2, 1, 1)
    + 16 * np.arange(2).reshape(1, 2, 1)
).astype(np.uint32)


def _pack_q6_kp(q: np.ndarray, params: list[np.ndarray], panels: int) -> np.ndarray:
    """Q6_K's unpacked form (q - 32 int8 [Np, K]; d repeated per block, sc of each half, [Np,
    nb]) -> Q6_KP's bytes. Field by field, so no temporary is wider than a byte a value."""
    n, k = q.shape
    nb, ns = k // BLOCK, k // QK_K
    u = (q.view(np.uint8) + np.uint8(32)).reshape(panels, PANEL, nb, BLOCK)  # q + 32: 0..63
    nibbles = (u[..., 0::2] & 0xF) | ((u[..., 1::2] & 0xF) << 4)  # [P, 16 cols, nb, 16 rows]
    fields = u.reshape(panels, PANEL, nb, 2, 2, 2, 4)  # [.., h, g, e, s]: k = 16h + 8g + 4e + s
    lanes = np.zeros((panels, PANEL, nb, 2), np.uint32)  # [P, 16 cols, nb, 2 h]
    for g in range(2):
        for e in range(2):
            for s in range(4):
                lanes |= (fields[..., g, e, s] >> 4).astype(np.uint32) << _Q6_SHIFTS[g, e, s]
    del u, fields
    sc = np.stack(params[1:3], axis=2).reshape(panels, PANEL, nb, 2)  # int8
    blocks = np.concatenate(
        [
            nibbles.transpose(0, 2, 3, 1).reshape(panels, nb, -1),
            np.ascontiguousarray(lanes.transpose(0, 2, 3, 1))
            .view(np.uint8)
            .reshape(panels, nb, -1),
            np.ascontiguousarray(sc.transpose(0, 2, 3, 1)).view(np.uint8).reshape(panels, nb, -1),
        ],
        axis=2,
    ).reshape(panels, ns, _Q6_SUPER * _Q6_BLOCK_BYTES)
    del nibbles, lanes
    d = params[0][:, ::_Q6_SUPER].reshape(panels, PANEL, ns).transpose(0, 2, 1)
    d_bytes = np.ascontiguousarray(d).view(np.uint8).reshape(panels, ns, 2 * PANEL)
    return np.concatenate([d_bytes, blocks], axis=2).reshape(-1)


def _unpack_q6_kp(data: torch.Tensor, panels: int, k: int) -> torch.Tensor:
    """Q6_KP's bytes -> the values (d * sc) * q, [P, nb, 32 k, 16 cols] fp32."""
    nb, ns = k // BLOCK, k // QK_K
    supers = data.view(panels, ns, -1)
    d = supers[:, :, : 2 * PANEL].contiguous().view(torch.float16).float()  # [P, ns, 16]
    blocks = supers[:, :, 2 * PANEL :].reshape(panels, ns, _Q6_SUPER, _Q6_BLOCK_BYTES)
    rows = blocks[..., : PANEL * BLOCK // 2].reshape(panels, ns, _Q6_SUPER, BLOCK // 2, PANEL)
    low = torch.stack([rows & 0xF, rows >> 4], dim=4).reshape(panels, ns, _Q6_SUPER, BLOCK, PANEL)
    lanes = blocks[..., PANEL * BLOCK // 2 : 3 * PANEL * BLOCK // 4].contiguous().view(torch.int32)
    lanes = lanes.reshape(panels, ns, _Q6_SUPER, 2, PANEL, 1, 1, 1).long()
    shifts = torch.from_numpy(_Q6_SHIFTS.astype(np.int64))
    top = (lanes >> shifts) & 3  # [P, ns, 8, 2 h, 16 cols, 2 g, 2 e, 4 s]
    top = top.permute(0, 1, 2, 3, 5, 6, 7, 4).reshape(low.shape)
    q = (low.long() | (top << 4)).float() - 32.0  # [P, ns, 8, 32 k, 16 cols]
    sc = blocks[..., 3 * PANEL * BLOCK // 4 :].contiguous().view(torch.int8).float()
    scale = d.view(panels, ns, 1, 1, PANEL) * sc.view(panels, ns, _Q6_SUPER, 2, PANEL)
    w = scale.unsqueeze(4) * q.view(panels, ns, _Q6_SUPER, 2, BLOCK // 2, PANEL)
    return w.reshape(panels, nb, BLOCK, PANEL)


def record_bytes(qtype: int) -> int:
    """Bytes of one (panel, block) record of kernel type ``qtype``: the values (Q5_KM: nibbles,
    then the fifth bits hb[8] uint64, bit 4c + i of hb[j] that of column c, k 4j + i), then
    d[16] fp16 (then Q4_1's m[16] fp16, Q4_G's z[16] uint8, Q4_K's dmin[16] fp16, sc[16] uint8, mn[16]
    uint8, Q6_K's sc[2][16] int8, or Q4_KM's / Q5_KM's dmin[16] fp16, sc[2][16] int8,
    mn[2][16] int8); Q6_KP: a super-block's bytes over its 8 blocks."""
    if qtype == Q6_KP:
        return (2 * PANEL + _Q6_SUPER * _Q6_BLOCK_BYTES) // _Q6_SUPER
    extra = {
        Q4_1: 2 * PANEL,
        Q4_G: PANEL,
        Q4_K: 4 * PANEL,
        Q6_K: 2 * PANEL,
        Q5_KM: 6 * PANEL,
        Q4_KM: 6 * PANEL,
    }.get(qtype, 0)
    return _values_bytes(qtype) + 2 * PANEL + extra


def num_panels(n: int) -> int:
    panels = cdiv(n, PANEL)
    return panels + (panels & 1)


def pack(q: np.ndarray, params: list[np.ndarray], qtype: int) -> np.ndarray:
    """Values q [N, K] and per-block params (each [N, nb]) -> the packed bytes of kernel type
    ``qtype``."""
    n, k = q.shape
    nb, panels = k // BLOCK, num_panels(n)
    pad = panels * PANEL - n  # zero columns: q 0, d 0 (z 0), so they add nothing
    q = np.pad(q, ((0, pad), (0, 0)))
    scales = [np.pad(s, ((0, pad), (0, 0))) for s in params]
    if qtype == Q6_KP:
        return _pack_q6_kp(q, scales, panels)
    values: np.ndarray
    if _byte_values(qtype):
        # [P, 16 cols, nb, 32 k] -> [P, nb, 32 k, 16 cols]
        # [P, 16 cols, nb, 8 quads, 4 k] -> [P, nb, 8 quads, 16 cols, 4 k]: a column's four k
        # in one 32-bit lane, as vpdpbusd reads them (ext/cpu_gemm_q.cpp)
        quads = q.reshape(panels, PANEL, nb, BLOCK // 4, 4)
        values = quads.transpose(0, 2, 3, 1, 4).view(np.uint8)
    else:
        pairs = q.reshape(panels, PANEL, nb, BLOCK // 2, 2).astype(np.uint8)
        packed = (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)  # [P, 16 cols, nb, 16]
        values = packed.transpose(0, 2, 3, 1)  # [P, nb, 16 pairs, 16 cols]
    parts = [np.ascontiguousarray(values).reshape(panels, nb, -1)]
    if qtype == Q5_KM:  # fifth bits [P, 16 cols, nb, 8 quads, 4 k] -> bit 4c + i of quad j's
        high = (q.reshape(panels, PANEL, nb, BLOCK // 4, 4) >> 4) & 1
        bits = np.ascontiguousarray(high.transpose(0, 2, 3, 1, 4)).reshape(panels, nb, -1, 64)
        parts.append(np.packbits(bits, axis=3, bitorder="little").reshape(panels, nb, -1))
    for s in scales:  # [Np, nb] fp16 or uint8 -> [P, nb, 16 cols] as bytes
        parts.append(
            np.ascontiguousarray(s.reshape(panels, PANEL, nb).transpose(0, 2, 1))
            .view(np.uint8)
            .reshape(panels, nb, -1)
        )
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)


def unpack(
    data: torch.Tensor,  # [panels * nb * record] uint8, as ``pack`` wrote it
    qtype: int,  # the packed form's kernel type
    n: int,
    k: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K]
    """The values ``pack`` packed, read back from the packed bytes: the reference."""
    nb, panels = k // BLOCK, num_panels(n)
    if qtype == Q6_KP:
        w6 = _unpack_q6_kp(data, panels, k).permute(0, 3, 1, 2).reshape(panels * PANEL, k)
        return w6[:n].to(dtype)
    records = data.view(panels, nb, record_bytes(qtype))
    values_bytes = _values_bytes(qtype)
    values = records[:, :, :values_bytes]
    if _byte_values(qtype):
        quads = values.reshape(panels, nb, BLOCK // 4, PANEL, 4).view(torch.int8)
        q = quads.permute(0, 1, 2, 4, 3).reshape(panels, nb, BLOCK, PANEL).to(torch.float32)
    else:
        pairs = values[:, :, : PANEL * BLOCK // 2].reshape(panels, nb, BLOCK // 2, PANEL)
        q = torch.stack([pairs & 0xF, pairs >> 4], dim=3).reshape(panels, nb, BLOCK, PANEL)
        q = q.to(torch.float32)  # [P, nb, 32 k, 16 cols]
        if qtype == Q5_KM:  # + 16 where bit 4c + i of quad j's mask is set (k = 4j + i)
            masks = values[:, :, PANEL * BLOCK // 2 :].reshape(panels, nb, BLOCK // 4, 8, 1)
            bits = (masks >> torch.arange(8, dtype=torch.uint8)) & 1  # [P, nb, 8 quads, 8, 8]
            bits = bits.reshape(panels, nb, BLOCK // 4, PANEL, 4).permute(0, 1, 2, 4, 3)
            q = q + 16 * bits.reshape(q.shape).to(torch.float32)  # [P, nb, 32 k, 16 cols]
    params = records[:, :, values_bytes:]
    d = params[:, :, : 2 * PANEL].contiguous().view(torch.float16).to(torch.float32).unsqueeze(2)
    if qtype in _HALF_MIN:  # (d * sc) * q - dmin * mn for each half block, as gguf_kquants'
        dmin = params[:, :, 2 * PANEL : 4 * PANEL].contiguous().view(torch.float16).float()
        sc, mn = (
            params[:, :, a : a + 2 * PANEL]
            .contiguous()
            .view(torch.int8)
            .float()
            .view(panels, nb, 2, PANEL)
            for a in (4 * PANEL, 6 * PANEL)
        )
        halves = q.view(panels, nb, 2, BLOCK // 2, PANEL)
        dl, ml = d * sc, dmin.unsqueeze(2) * mn  # [P, nb, 2, 16]
        w = (dl.unsqueeze(3) * halves - ml.unsqueeze(3)).view(q.shape)
    elif qtype == Q6_K:  # (d * sc) * q for each half block, as gguf_kquants' dequantizer
        sc = params[:, :, 2 * PANEL :].contiguous().view(torch.int8).float()  # [P, nb, 32]
        halves = q.view(panels, nb, 2, BLOCK // 2, PANEL)
        w = ((d * sc.view(panels, nb, 2, PANEL)).unsqueeze(3) * halves).view(q.shape)
    elif qtype == Q4_K:  # (d * sc) * q - dmin * mn, as gguf_kquants' reference dequantizer
        dmin = params[:, :, 2 * PANEL : 4 * PANEL].contiguous().view(torch.float16).float()
        sc, mn = (params[:, :, a : a + PANEL].float() for a in (4 * PANEL, 5 * PANEL))
        w = (d * sc.unsqueeze(2)) * q - (dmin * mn).unsqueeze(2)
    elif qtype == Q4_G:  # [P, nb, 1, 16] zero points, then (q - z) * d: exact in fp32
        w = (q - params[:, :, 2 * PANEL :].to(torch.float32).unsqueeze(2)) * d
    elif qtype == Q4_0:
        w = (q - 8.0) * d
    elif qtype == Q4_1:
        m = params[:, :, 2 * PANEL :].contiguous().view(torch.float16).to(torch.float32)
        w = q * d + m.unsqueeze(2)
    else:
        w = q * d
    w = w.permute(0, 3, 1, 2).reshape(panels * PANEL, k)[:n]  # [N, K]
    return w.to(dtype)
