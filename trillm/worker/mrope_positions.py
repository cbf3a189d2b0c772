"""M-RoPE positions of one request's tokens, from its images and videos alone (transformers'
``get_rope_index``, for any run of its tokens: a prefill chunk, a decode step, drafts).

An item whose patches are [t, h, w, ...] fills ``t * (h/m) * (w/m)`` placeholder tokens (m:
the spatial merge); starting at ``s`` (the position its first token would have as text), its
token j sits at (s + time, s + row, s + column) of the merged grid, time being the temporal
patch k (an image's 0; a video's ``floor(k * time_interval)``), and the text after it
continues from ``s + max(h/m, w/m)`` (a video's time is left out, as transformers 5 does). So
every token outside items is its index plus the shifts (``max(h/m, w/m) - tokens``) of the
items before it, generated tokens included: ``generate`` moves each on by one from the last.
"""

from __future__ import annotations

import numpy as np

from trillm.messages import MultiModalItem


def mrope_positions(
    items: list[MultiModalItem],  # the request's images and videos, in prompt order
    positions: np.ndarray,  # [n] int64: token indices in the request
    merge: int,  # the vision tower's spatial_merge_size
) -> np.ndarray:  # [3, n] int64: (time, row, column) positions
    out = np.repeat(positions[None], 3, axis=0)
    shift = 0  # of the items so far
    for item in items:
        t, h, w = item.shape[:3]
        rows, cols = h // merge, w // merge
        end = item.offset + item.length
        inside = (positions >= item.offset) & (positions < end)
        j = positions[inside] - item.offset
        time = _times(t, item.time_interval)  # [t]
        grid = np.stack([time[j // (rows * cols)], (j // cols) % rows, j % cols])  # [3, k]
        out[:, inside] = item.offset + shift + grid
        step = max(rows, cols) - item.length
        out[:, positions >= end] += step
        shift += step
    return out


def _times(t: int, interval: float) -> np.ndarray:  # [t] int64
    """Each temporal patch's time, as transformers computes it (float32, floored)."""
    return (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
