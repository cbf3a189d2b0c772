"""The KV offload tier's resolved config (``--kv-offloading-size``; ``offload_fit.py`` makes
it). Imports nothing of trillm's: ``trillm.config`` holds it."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("native", "lmcache")


@dataclass(frozen=True)
class KVOffloadConfig:
    num_blocks: int  # blocks the tier holds: floor(size / block_bytes)
    block_bytes: int  # one block over every layer and every rank
    size_bytes: int  # --kv-offloading-size in bytes (over every rank, as vLLM's)
    # each global rank's share of a block (its KV cache's block: its heads, its stage's layers)
    rank_block_bytes: tuple[int, ...] = ()
