"""What one layer's paged KV cache holds per token, as its model declares it
(``CausalLM.kv_cache_layout``). The runner sizes (``worker/kv_cache_sizing.py``) and allocates
the cache from it, and so does the draft model, so a block's bytes are the true bytes of its
tokens: ``--kv-cache-memory``, block counts, preemption and prefix caching all follow.

Whatever the layout, blocks, slots and the block table mean what ``backend.py`` says: the
token at position ``p`` lives in block ``block_table[i, p // block_size]`` at offset
``p % block_size``, the cache tensor being ``[planes, num_blocks, block_size, *entry]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheLayout:
    """``planes`` tensors of ``entry`` elements per token: K and V of a rank's KV heads are
    2 planes of ``(Hkv, head_dim)``; MLA's latent is 1 plane of ``(1, kv_lora_rank +
    qk_rope_head_dim)`` (the compressed K/V after ``kv_a_layernorm``, then the roped key)."""

    planes: int
    entry: tuple[int, ...]

    @classmethod
    def key_value(cls, num_kv_heads: int, head_dim: int) -> KVCacheLayout:
        return cls(2, (num_kv_heads, head_dim))

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.planes, num_blocks, block_size, *self.entry)

    @property
    def elements_per_token(self) -> int:
        return self.planes * math.prod(self.entry)
