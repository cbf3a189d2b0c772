"""GGML's quantized block formats as GGUF files store them: the type ids, block sizes, and
``unpack_ggml``, which turns a tensor's raw rows into values and per-block parameters in the form
``linear_q_cpu`` repacks for its kernel (``KERNEL_TYPES``: Q3_K and Q2_K as Q4_KM, Q5_K as
Q5_KM). The formats themselves are described in ``linear_q_cpu``'s docstring and, for the
K-quants, in ``trillm/model_executor/gguf_kquants.py``.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # values per block along K
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML's type ids (gguf.GGMLQuantizationType)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
Q4_G = 100  # trillm's: AWQ / GPTQ 4-bit groups as blocks of 32 with an fp16 scale, a zero point
Q5_KM = 101  # trillm's: 5-bit values, a scale and minimum per 16 (Q5_K's kernel type)
Q4_KM = 102  # trillm's: nibbles, a scale and minimum per 16 (Q3_K's and Q2_K's kernel type)
Q6_KP = 103  # trillm's: Q6_K at the file's size (its kernel type where the CPU has AVX512-BF16)
QTYPE_NAMES = {
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q8_0: "Q8_0",
    Q2_K: "Q2_K",
    Q3_K: "Q3_K",
    Q4_K: "Q4_K",
    Q5_K: "Q5_K",
    Q6_K: "Q6_K",
    Q4_G: "Q4_G",
    Q5_KM: "Q5_KM",
    Q4_KM: "Q4_KM",
    Q6_KP: "Q6_KP",
}
# a file type -> the kernel type it is repacked into (the others: itself; Q6_K -> Q6_KP where
# the kernel runs it, linear_q_cpu.kernel_type)
KERNEL_TYPES = {Q3_K: Q4_KM, Q5_K: Q5_KM, Q2_K: Q4_KM}
# Bytes of one GGML block: fp16 d (+ fp16 m), then the values.
GGML_BLOCK_BYTES = {Q4_0: 2 + 16, Q4_1: 4 + 16, Q8_0: 2 + 32}
QK_K = 256  # K-quants: values per super-block
KQUANT_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}  # bytes of a super-block


def unpack_ggml(raw: np.ndarray, qtype: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """GGML rows [N, K / 32 * block bytes] uint8 -> (q [N, K] uint8 or int8, the per-block
    parameters [N, K/32] each: d fp16, then Q4_1's m fp16, Q4_K's dmin fp16, sc uint8, mn
    uint8, Q6_K's two int8 scales, or Q5_K's, Q3_K's and Q2_K's dmin fp16, two int8 scales
    and two minimums): the values and parameters of ``KERNEL_TYPES``' form. Q4 nibbles:
    value j of a block is byte j's low half, value j + 16 its high half."""
    if qtype in KQUANT_BYTES:
        return _unpack_kquant(raw, qtype, k)
    if qtype not in GGML_BLOCK_BYTES:
        raise ValueError(f"unsupported quantized type id {qtype}")
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    n, nb = raw.shape[0], k // BLOCK
    blocks = np.ascontiguousarray(raw).reshape(n, nb, GGML_BLOCK_BYTES[qtype])
    d = blocks[:, :, 0:2].copy().view(np.float16).reshape(n, nb)
    if qtype == Q8_0:
        q = blocks[:, :, 2:].copy().view(np.int8).reshape(n, k)
        return q, [d]
    start = 4 if qtype == Q4_1 else 2
    params = [d]
    if qtype == Q4_1:
        params.append(blocks[:, :, 2:4].copy().view(np.float16).reshape(n, nb))
    nibbles = blocks[:, :, start:]  # [N, nb, 16]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=2).reshape(n, k)
    return q, params


def _unpack_kquant(raw: np.ndarray, qtype: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    if k % QK_K:
        raise ValueError(f"K={k} is not a multiple of {QK_K} ({QTYPE_NAMES[qtype]} super-blocks)")
    n, ns = raw.shape[0], k // QK_K
    blocks = np.ascontiguousarray(raw).reshape(n, ns, KQUANT_BYTES[qtype])
    unpack = {
        Q2_K: _unpack_q2_k,
        Q3_K: _unpack_q3_k,
        Q4_K: _unpack_q4_k,
        Q5_K: _unpack_q5_k,
        Q6_K: _unpack_q6_k,
    }[qtype]
    return unpack(blocks, n, k)


_SHIFTS_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)


def _unpack_q3_k(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Q3_K super-blocks [N, K/256, 110] (``gguf_kquants``' layout) -> Q4_KM's form: q + 4 in
    0..7 [N, K] uint8 and per block of 32: d fp16 (repeated) twice (as d and dmin), the int8
    scales sc - 32 of its halves and their minimums 4 (sc - 32): (d sc)(q + 4) - d (4 sc) =
    (d sc) q, exactly."""
    ns = k // QK_K
    hmask, qs = blocks[..., 0:32], blocks[..., 32:96]
    low = (qs.reshape(n, ns, 2, 1, 32) >> _SHIFTS_2BIT.reshape(4, 1)) & 3  # [N, ns, 2, 4, 32]
    # value 128 h + 32 j + l takes bit 4 h + j of hmask[l]; a clear bit subtracts 4
    bits = np.arange(8, dtype=np.uint8).reshape(2, 4, 1)
    high = (hmask.reshape(n, ns, 1, 1, 32) >> bits) & 1
    q = (low + 4 * high).reshape(n, k)  # q + 4: a clear bit is the 4 not added
    s = blocks[..., 96:108]  # scale i: a nibble of byte i % 8, two bits of byte 8 + i % 4
    low_s = np.concatenate([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], axis=2)  # [N, ns, 16]
    shifts = np.array([2 * (i // 4) for i in range(16)], dtype=np.uint8)
    high_s = (np.tile(s[..., 8:12], 4) >> shifts) & 3
    scales = ((low_s | (high_s << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k // 16)
    d = np.repeat(blocks[..., 108:110].copy().view(np.float16).reshape(n, ns), 8, axis=1)
    mins = (4 * scales.astype(np.int16)).astype(np.int8)  # -128..124
    return q, [d, d, scales[:, 0::2], scales[:, 1::2], mins[:, 0::2], mins[:, 1::2]]


def _unpack_q2_k(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Q2_K super-blocks [N, K/256, 84] -> Q4_KM's form: q 0..3 [N, K] uint8 and per block of
    32: d, dmin fp16 (repeated), the 4-bit scales and minimums of its two halves (int8)."""
    ns = k // QK_K
    qs = blocks[..., 16:80].reshape(n, ns, 2, 1, 32)
    # value 128 h + 32 j + l: 2-bit field j of byte l of half h's qs
    q = ((qs >> _SHIFTS_2BIT.reshape(4, 1)) & 3).reshape(n, k)
    sc = blocks[..., 0:16].reshape(n, k // 16)  # one byte per 16 values: scale low, min high
    d, dmin = (
        np.repeat(blocks[..., a : a + 2].copy().view(np.float16).reshape(n, ns), 8, axis=1)
        for a in (80, 82)
    )
    scales, mins = (sc & 0xF).view(np.int8), (sc >> 4).view(np.int8)
    return q, [d, dmin, scales[:, 0::2], scales[:, 1::2], mins[:, 0::2], mins[:, 1::2]]


def _unpack_q5_k(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Q5_K super-blocks [N, K/256, 176] -> Q5_KM's form: q 0..31 [N, K] uint8 and per block of
    32: d, dmin fp16 (repeated), its 6-bit scale twice and its minimum twice (both halves)."""
    ns = k // QK_K
    as_q4_k = np.concatenate([blocks[..., 0:16], blocks[..., 48:176]], axis=2)  # without qh
    q4, params = _unpack_q4_k(as_q4_k, n, k)
    qh = blocks[..., 16:48].reshape(n, ns, 1, 32)  # block j's fifth bit: bit j of qh[l]
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [N, ns, 8, 32]
    q = q4 | (high.reshape(n, k) << 4)
    d, dmin, sc, mn = (params[0], params[1], params[2].view(np.int8), params[3].view(np.int8))
    return q, [d, dmin, sc, sc, mn, mn]


def _unpack_q6_k(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Q6_K super-blocks [N, K/256, 210] (``gguf_kquants``' layout) -> q - 32 [N, K] int8 and
    per block of 32: d fp16 (the super-block's, repeated), the int8 scales of its two halves."""
    ns = k // QK_K
    ql, qh = blocks[..., 0:128].reshape(n, ns, 2, 1, 2, 32), blocks[..., 128:192]
    low = np.concatenate([ql & 0xF, ql >> 4], axis=3).reshape(n, ns, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (qh.reshape(n, ns, 2, 1, 32) >> shifts) & 3  # half h, group g: field g of qh[32h + l]
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    scales = blocks[..., 192:208].copy().view(np.int8).reshape(n, k // 16)  # one per 16 values
    d = np.repeat(blocks[..., 208:210].copy().view(np.float16).reshape(n, ns), 8, axis=1)
    return q, [d, scales[:, 0::2], scales[:, 1::2]]


def _unpack_q4_k(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Q4_K super-blocks [N, K/256, 144] (``gguf_kquants``' layout) -> q [N, K] uint8 and per
    block of 32: d, dmin fp16 (the super-block's, repeated), sc, mn uint8 (the 6-bit fields)."""
    ns = k // QK_K
    d, dmin = (blocks[:, :, a : a + 2].copy().view(np.float16).reshape(n, ns) for a in (0, 2))
    s = blocks[:, :, 4:16]
    first, second, third = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # see gguf_kquants
    sc = np.concatenate([first & 63, (third & 0xF) | ((first >> 6) << 4)], axis=2)  # [N, ns, 8]
    mn = np.concatenate([second & 63, (third >> 4) | ((second >> 6) << 4)], axis=2)
    qs = blocks[:, :, 16:].reshape(n, ns, 4, 1, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(n, k)
    per_block = [np.repeat(d, 8, axis=1), np.repeat(dmin, 8, axis=1)]
    return q, [*per_block, sc.reshape(n, -1), mn.reshape(n, -1)]
