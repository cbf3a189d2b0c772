"""Packed token bitmasks: bit ``j`` of int32 word ``w`` set = token ``32 * w + j`` is in the set.

The same layout as the structured-output (xgrammar) bitmask, reused for the per-slot sets the
sampler keeps (prompt tokens, allowed tokens, stop tokens): a set costs ``V / 8`` bytes per slot
instead of ``V`` bytes for a bool row.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

_BIT_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack_token_ids(token_ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """The set ``token_ids`` as packed words: int32 [num_words(vocab_size)]."""
    bits = np.zeros(num_words(vocab_size) * 32, dtype=np.bool_)
    ids = np.fromiter(token_ids, dtype=np.int64)
    bits[ids] = True
    # NOTE: little bit order within bytes + little-endian words gives bit j of word w = token
    # 32 * w + j on every host.
    return np.packbits(bits, bitorder="little").view(np.dtype("<i4")).astype(np.int32)


def _bit_shifts(device: torch.device) -> torch.Tensor:
    shifts = _BIT_SHIFTS_CACHE.get(device)
    if shifts is None:
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        _BIT_SHIFTS_CACHE[device] = shifts
    return shifts


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """words: int32 [n, W] -> bool [n, vocab_size], True where the bit is set."""
    n, w = words.shape
    # bits: [n, W, 32]; an arithmetic shift of a negative word still leaves bit 31 in bit 0.
    bits = (words.unsqueeze(-1) >> _bit_shifts(words.device)) & 1
    return bits.view(n, w * 32)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor) -> None:
    """In place: logits [n, V] of tokens whose bit is clear in words [n, W] become -inf."""
    allowed = unpack_bitmask(words.to(device=logits.device, dtype=torch.int32), logits.shape[1])
    logits.masked_fill_(~allowed, float("-inf"))
