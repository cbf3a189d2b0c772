"""The KV offload tier's scheduler side (vLLM's ``OffloadingConnector`` with its LRU manager,
``--kv-offloading-size``): which KV blocks the tier holds, keyed by the prefix cache's chain
hash, and what the worker side (``offload_worker.py``) copies each step.

Stores are write-through, as vLLM's: every full block a step computes is copied to the tier
after the step's forward unless the tier holds that content already, taking a free tier block
or the least recently used one. A waiting request whose prefix the KV cache no longer holds
(evicted, or the request was preempted) finds the blocks that follow its local prefix-cache
hit in the tier, whole blocks in order, never its last prompt token: they are loaded into its
blocks before the forward instead of computed (``get_num_new_matched_tokens``). A hit also
compares the block's token ids, so a hash collision cannot load another prefix's KV.

The worker runs a step's loads before its forward and its saves after it, so a tier block a
save of the same step takes over is read first by any load of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from trillm.core.kv_cache_manager import hash_block_tokens, request_extra_keys
from trillm.core.request import Request
from trillm.kv_transfer.base import LoadsAndSaves
from trillm.messages import KVOffloadStats, KVTransferItem, SchedulerOutput


class OffloadTier:
    """The tier's blocks: content hash -> tier block, least recently used first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> tier block
        self._tokens: dict[int, tuple[int, ...]] = {}  # tier block -> its token ids
        self._free = list(range(num_blocks - 1, -1, -1))  # never used yet (popped from the end)

    def __len__(self) -> int:
        return len(self._lru)

    def find(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        block = self._lru.get(block_hash)
        return block if block is not None and self._tokens[block] == tokens else None

    def touch(self, block_hash: int) -> None:
        self._lru.move_to_end(block_hash)

    def put(self, block_hash: int, tokens: tuple[int, ...]) -> int:
        """A tier block for new content: a free one, else the least recently used one's."""
        old = self._lru.pop(block_hash, None)  # NOTE: a hash collision: its block is reused
        if old is not None:
            block = old
        elif self._free:
            block = self._free.pop()
        else:
            _, block = self._lru.popitem(last=False)
        self._lru[block_hash] = block
        self._tokens[block] = tokens
        return block


def block_hashes(request: Request, block_size: int) -> list[int]:
    """The request's full blocks' chain hashes, the prefix cache's (``kv_cache_manager.py``;
    the native twin computes the same), those it lacks computed here (kept in the Python
    twin's request; the native twin's ``block_hashes`` is a copy)."""
    hashes = request.block_hashes
    first, later = request_extra_keys(request)
    tokens = request.all_token_ids
    for i in range(len(hashes), request.num_tokens // block_size):
        parent = hashes[i - 1] if i > 0 else None
        chunk = tokens[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, chunk, first if i == 0 else later))
    return hashes


class OffloadScheduler(LoadsAndSaves[tuple[int, list[int]]]):
    """The scheduler side (``base.KVConnectorScheduler``). A lookup: (first block, tier
    blocks). ``_not_loaded``: requests whose load failed, computed instead."""

    def __init__(
        self, num_blocks: int, block_size: int, rank_block_bytes: tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        self.tier = OffloadTier(num_blocks)
        self.block_size = block_size
        # vLLM's vllm:kv_offload_* series: what each step's loads and stores move, on each
        # rank (its share of a block: ``offload_config.KVOffloadConfig.rank_block_bytes``)
        self.rank_block_bytes = rank_block_bytes
        self.transfers = KVOffloadStats()
        self._stored: dict[str, int] = {}  # req_id -> its leading blocks the tier has seen

    def _block(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if request.skip_prefix_lookup or request.request_id in self._not_loaded:
            return 0  # NOTE: prompt logprobs need every prompt position computed
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # never the last token's block
        hashes = block_hashes(request, self.block_size)
        tokens = request.all_token_ids  # NOTE: the native twin's is a copy: taken once
        found: list[int] = []
        for i in range(first, last):
            block = self.tier.find(hashes[i], self._block(tokens, i))
            if block is None:
                break
            found.append(block)
        self._lookups[request.request_id] = (first, found)
        return len(found) * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int]) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        first, found = lookup
        self._queries += request.num_tokens
        if not found:
            return
        end = first + len(found)
        hashes = block_hashes(request, self.block_size)
        for i in range(first, end):
            self.tier.touch(hashes[i])
        bs = self.block_size
        self._hits += len(found) * bs
        self.transfers.loads.observe([len(found) * b for b in self.rank_block_bytes])
        self._loads.append(
            KVTransferItem(request.request_id, "", block_ids[:end], end * bs, first, found)
        )
        self._loaded[request.request_id] = (len(found) * bs, first * bs)

    def _saves(
        self,
        out: SchedulerOutput,
        request_of: Callable[[str], Request],
        block_ids_of: Callable[[str], list[int]],
    ) -> Iterator[KVTransferItem]:
        for req_id in out.num_scheduled_tokens:
            save = self._save(request_of(req_id), block_ids_of(req_id))
            if save is not None:
                yield save

    def _save(self, request: Request, block_ids: list[int]) -> KVTransferItem | None:
        """The request's blocks this step completes that the tier lacks (None: none)."""
        req_id = request.request_id
        start = self._stored.get(req_id, 0)
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full <= start:
            return None
        self._stored[req_id] = full
        hashes = block_hashes(request, self.block_size)
        tokens = request.all_token_ids
        blocks, targets = [], []
        for i in range(start, full):
            block = self._block(tokens, i)
            if self.tier.find(hashes[i], block) is not None:
                self.tier.touch(hashes[i])
                continue
            blocks.append(block_ids[i])
            targets.append(self.tier.put(hashes[i], block))
        if not blocks:
            return None
        self.transfers.stores.observe([len(blocks) * b for b in self.rank_block_bytes])
        return KVTransferItem(req_id, "", blocks, len(blocks) * self.block_size, 0, targets)

    def load_failed(self, req_id: str) -> int:
        n, computed = self._loaded.pop(req_id)
        self._hits -= n  # counted when it was admitted: not loaded after all
        self._not_loaded.add(req_id)
        self._stored[req_id] = computed // self.block_size  # its blocks are computed again
        return computed

    def request_finished(self, req_id: str) -> None:
        self._stored.pop(req_id, None)
        self._loaded.pop(req_id, None)
        self._not_loaded.discard(req_id)
        self._lookups.pop(req_id, None)
