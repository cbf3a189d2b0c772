"""vLLM's ``SharedStorageConnector``: prompts' KV blocks as files in a folder both instances
see (``storage.py``). A producer (kv_producer, kv_both) saves a request's prompt once its
prompt is computed; a consumer (kv_consumer, kv_both) loads a waiting request's prompt from
the file of the same tokens, so those tokens are not computed again. Both sides store the
prompt's longest block-aligned prefix short of its last token (vLLM's
``align_to_block_size(len(prompt) - 1)``): the consumer computes the rest.

A file that is missing, another model's, truncated or damaged is no match: the request is
computed as without a connector, never from bad KV.

Tensor and pipeline parallelism: each rank's worker saves and loads its own share (its KV
heads, its stage's layers) as its own file; the scheduler side (one per engine core) finds a
prefix only when every rank's file is there, and a load that fails on one rank fails on all
(``rank_agreement.py``), so a request is never run on a mix of loaded and computed KV.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import torch

from trillm.config import TrillmConfig
from trillm.core.request import Request
from trillm.distributed.pipeline import stage_layers
from trillm.kv_transfer.base import BlockWorker, KVConnectorWorker, LoadsAndSaves, NoConnector
from trillm.kv_transfer.config import KVTransferConfig
from trillm.kv_transfer.disk_budget import DiskBudget, rank_share, touch
from trillm.kv_transfer.kv_blocks import gather, scatter
from trillm.kv_transfer.p2p import P2pWorker
from trillm.kv_transfer.storage import (
    cache_identity,
    file_path,
    file_size,
    prefix_key,
    rank_identity,
    rank_suffix,
    read_file,
    read_header,
    write_file,
)
from trillm.messages import KVTransferItem, SchedulerOutput

logger = logging.getLogger(__name__)


class SharedStorageScheduler(LoadsAndSaves[tuple[str, int, int]]):
    """The scheduler side (``base.KVConnectorScheduler``). A lookup: (key, tokens in the file,
    tokens computed before it). ``_loaded``: req_id -> (tokens in the file, tokens computed
    before it). ``_not_loaded``: requests whose load failed: computed instead, never looked up
    again. (P2P: ``p2p_scheduler.P2pScheduler`` looks up what its receiver got instead.)"""

    def __init__(
        self, kv: KVTransferConfig, identity: str, block_size: int, world_size: int = 1
    ) -> None:
        super().__init__()
        self.kv = kv
        self.identity = identity
        self.block_size = block_size
        self.world_size = world_size  # every rank's file must be there (tensor x pipeline)
        self._saved: set[str] = set()  # requests whose prompt was saved (or has no full block)
        self._found: dict[str, str] = {}  # req_id -> key of its file, its header checked once

    def _prefix(self, request: Request) -> tuple[str, int]:
        n = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        tokens = request.prompt_token_ids[:n]
        return prefix_key(self.identity, tokens, request.cache_salt, request.extra_hash_keys), n

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.kv.is_consumer or request.skip_prefix_lookup:
            return 0
        if request.request_id in self._not_loaded:
            return 0  # NOTE: prompt logprobs need every prompt position computed
        key, n = self._prefix(request)
        self._lookups[request.request_id] = (key, 0, num_computed_tokens)
        if n <= num_computed_tokens:
            return 0
        # NOTE: on the engine loop: the headers alone (one small read per rank), never the
        # payloads, whose digests the workers check; a head that waits for blocks reads them once
        if self._found.get(request.request_id) != key:
            if not self._every_rank_has(key, n):
                return 0
            self._found[request.request_id] = key
        self._lookups[request.request_id] = (key, n, num_computed_tokens)
        return n - num_computed_tokens

    def _every_rank_has(self, key: str, n: int) -> bool:
        """Whether each rank's file of ``key`` is whole, of this model and of ``n`` tokens (by
        its header): one rank's part missing and the prefix is computed on every rank."""
        world = self.world_size
        for rank in range(world):
            path = file_path(self.kv.shared_storage_path, key, rank, world)
            if read_header(path, rank_identity(self.identity, rank, world), n) is None:
                if os.path.exists(path):
                    logger.warning("KV file %s is truncated or not this model's: recomputing", path)
                return False
        return True

    def update_state_after_alloc(self, request: Request, block_ids: list[int]) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        key, n, computed = lookup
        self._queries += request.num_tokens
        if n > computed:
            self._hits += n - computed
            first = computed // self.block_size
            blocks = block_ids[: n // self.block_size]
            self._loads.append(KVTransferItem(request.request_id, key, blocks, n, first))
            self._loaded[request.request_id] = (n, computed)
            self._saved.add(request.request_id)  # kv_both: its file is there already

    def _saves(
        self,
        out: SchedulerOutput,
        request_of: Callable[[str], Request],
        block_ids_of: Callable[[str], list[int]],
    ) -> Iterator[KVTransferItem]:
        if not self.kv.is_producer:
            return
        for req_id in out.num_scheduled_tokens:
            request = request_of(req_id)
            if req_id in self._saved or request.num_computed_tokens < request.num_prompt_tokens:
                continue  # saved already, or its prompt is not computed by this step's end
            self._saved.add(req_id)
            key, n = self._prefix(request)
            if n > 0:
                blocks = block_ids_of(req_id)[: n // self.block_size]
                yield KVTransferItem(req_id, key, blocks, n, 0)

    def load_failed(self, req_id: str) -> int:
        n, computed = self._loaded.pop(req_id)
        self._hits -= n - computed  # counted when it was admitted: not loaded after all
        self._not_loaded.add(req_id)
        self._saved.discard(req_id)  # kv_both: its file is damaged, save what it computes
        return computed

    def request_finished(self, req_id: str) -> None:
        self._saved.discard(req_id)
        self._loaded.pop(req_id, None)
        self._not_loaded.discard(req_id)
        self._found.pop(req_id, None)
        self._lookups.pop(req_id, None)


class SharedStorageWorker(BlockWorker):
    """The worker side (``base.KVConnectorWorker``): files in, files out."""

    def __init__(self, config: TrillmConfig, kv: KVTransferConfig, rank: int = 0) -> None:
        self.folder = kv.shared_storage_path
        parallel = config.parallel
        self.rank, self.world_size = rank, parallel.world_size  # this rank's files, its share
        self.identity = rank_identity(cache_identity(config), rank, self.world_size)
        self.budget: DiskBudget | None = None  # a producer's bound on the folder's bytes
        if kv.is_producer:
            os.makedirs(self.folder, exist_ok=True)
            layers = config.model.num_hidden_layers
            stages = parallel.pipeline_parallel_size
            first, end = stage_layers(layers, stages, rank // parallel.tensor_parallel_size)
            share = rank_share(layers, end - first, parallel.tensor_parallel_size)
            suffix = rank_suffix(rank, self.world_size)
            self.budget = DiskBudget(self.folder, kv.max_local_disk_size, suffix, share)

    def _path(self, key: str) -> str:
        return file_path(self.folder, key, self.rank, self.world_size)

    def _load(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        path = self._path(item.key)
        found = read_file(path, self.identity, item.num_tokens)
        if found is None:  # NOTE: the scheduler read its header only: the payload is checked here
            raise RuntimeError(
                f"KV file {path} is damaged, or changed after the scheduler's lookup."
            )
        scatter(item, kv_caches, *found)
        touch(path)  # NOTE: used: the producer's LRU evicts it last

    def _save(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        header, payload = gather(item, kv_caches, self.identity)
        path = self._path(item.key)
        if self.budget is not None and not self.budget.admit(path, file_size(header)):
            return  # NOTE: over max_local_disk_size alone: counted, the consumer recomputes
        write_file(path, header, payload)
        if self.budget is not None:
            self.budget.written(path)


def worker_connector(config: TrillmConfig, rank: int = 0) -> KVConnectorWorker:
    """The worker side of the engine's connector on global rank ``rank`` (a no-op without
    one)."""
    if config.kv_transfer is None:
        return NoConnector()
    if config.kv_transfer.p2p is not None:
        return P2pWorker(config, config.kv_transfer, rank)
    return SharedStorageWorker(config, config.kv_transfer, rank)
