"""The KV block manager (pure-Python twin of ``ext/kv_cache_manager.pyx``).

A pool of ``num_blocks`` blocks of ``block_size`` token slots. A request's block table lists
the blocks holding its tokens in order; blocks are reference counted so requests sharing a
prefix share blocks.

Prefix caching: each FULL block gets a chain hash of (parent block hash, its token ids, extra
keys) where the extra keys are the request's ``extra_hash_keys`` on every block and its
``cache_salt`` on the first block only (the chain carries it on). ``_cached`` maps a hash to
the block holding that content. A freed block keeps its hash and sits in an LRU free queue;
it is evicted lazily (hash entry dropped) when it is taken from the head for new content, and
taken out of the middle when a prefix lookup hits it.

Hashes are 128 bits (two 64-bit lanes of a splitmix64-style mix) and a hit also compares the
block's stored token ids, so a collision cannot return a wrong block's KV. The native twin
computes the same values (tests compare them).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from trillm.core.errors import BlockAllocationError
from trillm.core.request import Request
from trillm.utils import cdiv

_M64 = (1 << 64) - 1
_ROOT_LO = 0x243F6A8885A308D3  # parent "hash" of a first block (digits of pi)
_ROOT_HI = 0x13198A2E03707344
_END_OF_TOKENS = 1 << 63


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hash_block_tokens(
    parent_hash: int | None, token_ids: Sequence[int], extra: Sequence[int]
) -> int:
    """128-bit chain hash of one full block. ``extra``: 64-bit keys (see string_hash_key)."""
    if parent_hash is None:
        lo, hi = _ROOT_LO, _ROOT_HI
    else:
        lo, hi = parent_hash & _M64, parent_hash >> 64
    h1 = _mix64(lo ^ 0x9E3779B97F4A7C15)
    h2 = _mix64(hi ^ 0xD6E8FEB86659FD93)
    for words in (token_ids, (_END_OF_TOKENS | len(token_ids),), extra, (len(extra),)):
        for w in words:
            v = w & _M64
            h1 = _mix64(h1 ^ v)
            h2 = _mix64(((h2 + v) * 0xFF51AFD7ED558CCD) & _M64)
    return (h2 << 64) | h1


def string_hash_key(s: str) -> int:
    """A stable 64-bit key for a string extra key (process independent, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def request_extra_keys(request: Request) -> tuple[list[int], list[int]]:
    """(keys of the first block, keys of every later block) for a request."""
    every = [string_hash_key("x:" + k) for k in request.extra_hash_keys]
    if request.cache_salt is None:
        return every, every
    return [string_hash_key("salt:" + request.cache_salt), *every], every


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}."
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # LRU free queue: head = next to evict. Holds every block with ref count 0.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}  # req_id -> block ids
        self._num_cached_blocks: dict[str, int] = {}  # req_id -> leading blocks already cached
        self.prefix_cache_queries = 0  # tokens looked up at admission (cumulative)
        self.prefix_cache_hits = 0  # tokens found (cumulative)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_block_ids(self, req_id: str) -> list[int]:
        return list(self._tables.get(req_id, ()))

    def get_ref_counts(self) -> list[int]:
        return list(self._ref_cnt)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (head first)."""
        return list(self._free)

    def num_cached_blocks_total(self) -> int:
        return len(self._cached)

    def num_cache_written_tokens(self, request: Request) -> int:
        """Prompt tokens in the request's blocks registered in the prefix cache (its hits
        included): vLLM's ``estimate_cached_tokens`` capped at the prompt; 0 without caching."""
        num = self._num_cached_blocks.get(request.request_id, 0) * self.block_size
        return min(num, request.num_prompt_tokens)

    def block_hashes(self, request: Request) -> list[int]:
        self._update_block_hashes(request)
        return list(request.block_hashes)

    # ------------------------------------------------------------------ prefix lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks -> (block ids, num tokens they hold).

        NOTE: never the whole sequence: the last token is always left to compute so the step
        produces logits for it.
        """
        if not self.enable_prefix_caching or request.skip_prefix_lookup:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request)
        blocks: list[int] = []
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(max_blocks):
            block = self._cached.get(request.block_hashes[i])
            if block is None or self._block_tokens[block] != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    # ------------------------------------------------------------------ allocation

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, num_computed_blocks: int
    ) -> int:
        held = len(self._tables.get(request.request_id, ())) + num_computed_blocks
        total_tokens = request.num_computed_tokens + num_computed_blocks * self.block_size
        needed = cdiv(total_tokens + num_new_tokens, self.block_size)
        return max(0, needed - held)

    def can_allocate(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Whether ``allocate_slots`` with the same arguments will succeed."""
        # Hit blocks nobody references sit in the free queue: taking them costs free slots.
        revived = sum(1 for b in new_computed_blocks if self._ref_cnt[b] == 0)
        needed = self._num_new_blocks(request, num_new_tokens, len(new_computed_blocks))
        return needed + revived <= len(self._free)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
    ) -> list[int]:
        """Give ``request`` room for ``num_new_tokens`` more tokens -> the new block ids.

        ``new_computed_blocks`` (from get_computed_blocks) is passed when a waiting request is
        admitted; that admission records the prefix-cache lookup in the counters.
        """
        computed = list(new_computed_blocks or ())
        if not self.can_allocate(request, num_new_tokens, computed):
            raise BlockAllocationError(
                f"Request {request.request_id!r} needs more blocks than the {len(self._free)} "
                f"free ones for {num_new_tokens} new tokens; call can_allocate first."
            )
        if new_computed_blocks is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed) * self.block_size
        num_new = self._num_new_blocks(request, num_new_tokens, len(computed))
        table = self._tables.setdefault(request.request_id, [])
        for block in computed:
            self._take_ref(block)
        table.extend(computed)
        if computed:
            self._num_cached_blocks[request.request_id] = len(table)
        new_blocks = [self._take_fresh_block() for _ in range(num_new)]
        table.extend(new_blocks)
        return new_blocks

    def _take_ref(self, block: int) -> None:
        if self._ref_cnt[block] == 0:
            del self._free[block]
        self._ref_cnt[block] += 1

    def _take_fresh_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        self._evict(block)
        self._ref_cnt[block] = 1
        return block

    def _evict(self, block: int) -> None:
        block_hash = self._block_hash[block]
        if block_hash is not None:
            if self._cached.get(block_hash) == block:
                del self._cached[block_hash]
            self._block_hash[block] = None
            self._block_tokens[block] = None

    # ------------------------------------------------------------------ free / cache

    def free(self, request: Request) -> None:
        """Drop the request's references; tail blocks enter the LRU queue first (evicted first)."""
        table = self._tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table is None:
            return
        for block in reversed(table):
            self._ref_cnt[block] -= 1
            if self._ref_cnt[block] == 0:
                self._free[block] = None

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed (< num_computed_tokens)."""
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        table = self._tables.get(req_id)
        if table is None:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(table))
        start = self._num_cached_blocks.get(req_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        bs = self.block_size
        for i in range(start, num_full):
            block = table[i]
            block_hash = request.block_hashes[i]
            if self._block_hash[block] is not None or block_hash in self._cached:
                continue  # a prefix hit, or the same content already cached in another block
            self._cached[block_hash] = block
            self._block_hash[block] = block_hash
            self._block_tokens[block] = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
        self._num_cached_blocks[req_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        if len(hashes) >= num_full:
            return
        first, later = request_extra_keys(request)
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i > 0 else None
            extra = first if i == 0 else later
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their KV but are no longer shareable."""
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        self._block_tokens = [None] * self.num_blocks
