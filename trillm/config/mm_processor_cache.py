"""``mm_processor_cache_gb`` (vLLM's engine argument): checked when the engine arguments are
built; the cache itself is the frontend's (``trillm/engine/mm_processor_cache.py``)."""

from __future__ import annotations

import math
from typing import Any

DEFAULT_MM_PROCESSOR_CACHE_GB = 4.0  # vLLM's default


def check_mm_processor_cache_gb(value: Any) -> float:
    """A finite number of GiB >= 0 (0: no cache); ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"mm_processor_cache_gb must be a number >= 0, got {value!r}.")
    if math.isinf(value):
        raise ValueError("mm_processor_cache_gb must be finite, got inf.")
    return float(value)
