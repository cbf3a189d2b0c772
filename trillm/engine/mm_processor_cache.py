"""``--mm-processor-cache-gb`` (vLLM's flag): the frontend's cache of processed items.

An image sent again (a chat's history carries its images to every turn) skips the image
processor (resize, rescale, normalize, patching): its output is kept under a key made of the
decoded pixels' hash and the processor keywords the request resolved, least recently used
first out once the kept outputs pass the byte budget. 0 GiB disables the cache. Its queries
and hits are vLLM's ``vllm:mm_cache_queries`` / ``vllm:mm_cache_hits`` (in items).

The key hashes the decoded pixels, not the request's bytes: the same picture sent as PNG and
as a ``file://`` URL is one entry, and the bytes were decoded anyway (the processor's input).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

GIB = 1 << 30


def item_key(pixels: np.ndarray, kwargs: dict[str, Any]) -> str:
    """The cache key of one decoded image ([H, W, 3] uint8) processed with ``kwargs``."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((pixels.dtype.str, pixels.shape)).encode())
    digest.update(np.ascontiguousarray(pixels).data)
    # repr: a keyword's value need not be JSON (a tuple size); sort_keys: order is not meaning
    digest.update(json.dumps(kwargs, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


class ProcessorCache:
    """Processed items by key, least recently used out past ``capacity_bytes``. Thread-safe:
    the image processor runs in worker threads (``trio.to_thread``), several at once."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.size_bytes = 0
        self.queries = 0  # items looked up (vllm:mm_cache_queries)
        self.hits = 0  # of those, found (vllm:mm_cache_hits)

    @classmethod
    def from_gb(cls, gb: float) -> ProcessorCache | None:
        """None when disabled (0 GiB)."""
        return cls(int(gb * GIB)) if gb > 0 else None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> np.ndarray | None:
        with self._lock:
            self.queries += 1
            value = self._entries.get(key)
            if value is not None:
                self.hits += 1
                self._entries.move_to_end(key)
            return value

    def put(self, key: str, value: np.ndarray) -> None:
        """Keeps ``value`` (read-only from now on: hits share it); one larger than the whole
        budget is not kept."""
        if value.nbytes > self.capacity_bytes:
            return
        value.flags.writeable = False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.size_bytes -= old.nbytes
            self._entries[key] = value
            self.size_bytes += value.nbytes
            while self.size_bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.size_bytes -= evicted.nbytes
