"""Batched LoRA, torch reference (CPU or GPU): Punica-style shrink and expand with a per-token
adapter slot.

One step's tokens may use different adapters. Each targeted linear keeps its adapters stacked
by slot: ``a`` [L, R, in] (A) and ``bt`` [L, R, out] (B transposed), ``scales`` [L] fp32;
``slots`` [T] int64 names each token's slot, -1 for the base model. Then

- ``shrink``: ``buf[t] = scales[s] * (x[t] @ a[s]^T)``, fp32 [T, R] (zero rows for slot -1);
- ``expand_``: ``y[t] += buf[t] @ bt[s]`` in place, summed in fp32 and rounded to y's dtype
  once; rows of slot -1 are not touched.

The native CPU kernel (``lora_cpu``) and the Triton kernel (``lora_triton``) keep this
contract; tests compare them to it.
"""

from __future__ import annotations

import torch


def _groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token rows [n] long) for every slot that has tokens."""
    used = torch.unique(slots[slots >= 0]).tolist()
    return [(s, torch.nonzero(slots == s).squeeze(1)) for s in used]


def shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [L, R, in]
    slots: torch.Tensor,  # [T] int64, -1 = no adapter
    scales: torch.Tensor,  # [L] fp32
) -> torch.Tensor:  # [T, R] fp32
    buf = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _groups(slots):
        xs = x.index_select(0, rows).float()  # [n, in]
        buf[rows] = (xs @ a[slot].float().t()) * scales[slot]
    return buf


def expand_(
    y: torch.Tensor,  # [T, out], updated in place
    buf: torch.Tensor,  # [T, R] fp32
    bt: torch.Tensor,  # [L, R, out]
    slots: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    for slot, rows in _groups(slots):
        delta = buf.index_select(0, rows) @ bt[slot].float()  # [n, out]
        y[rows] = (y.index_select(0, rows).float() + delta).to(y.dtype)
    return y


def add_lora_(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [L, R, in]
    bt: torch.Tensor,  # [L, R, out]
    slots: torch.Tensor,  # [T] int64
    scales: torch.Tensor,  # [L] fp32
) -> torch.Tensor:
    """``expand_(y, shrink(x, ...), ...)``: y plus each token's adapter delta, in place."""
    return expand_(y, shrink(x, a, slots, scales), bt, slots)
