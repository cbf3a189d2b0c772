"""The scheduler with a KV connector: either scheduler twin (the native one when built and
enabled, else ``core/scheduler.py``) asking the connector's scheduler side
(``base.KVConnectorScheduler``) for a waiting request's external tokens. ``ConnectorSteps``
holds the connector's part once, for both twins: their admission calls
``_num_external_tokens`` and their finish ``_finish``, which it extends (the native twin
declares both ``cpdef`` so that a Python subclass can)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from trillm._native import get_scheduler_cls
from trillm.config import CacheConfig, SchedulerConfig, TrillmConfig
from trillm.core.request import Request
from trillm.core.scheduler import Scheduler
from trillm.kv_transfer.base import KVConnectorScheduler
from trillm.kv_transfer.offload import OffloadScheduler
from trillm.kv_transfer.p2p import p2p_identity
from trillm.kv_transfer.p2p_scheduler import P2pScheduler
from trillm.kv_transfer.shared_storage import SharedStorageScheduler
from trillm.kv_transfer.storage import cache_identity
from trillm.messages import EngineCoreRequest, FinishReason, SchedulerOutput, SchedulerStats

logger = logging.getLogger(__name__)

# vLLM's vllm:prompt_tokens_by_source labels
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


if TYPE_CHECKING:
    _SchedulerTwin = Scheduler
else:
    _SchedulerTwin = object  # NOTE: a mixin: the twin it extends follows it in the MRO


class ConnectorSteps(_SchedulerTwin):
    """A KV connector's part of the scheduler, on either twin (``connector_scheduler_cls``)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        connector: KVConnectorScheduler,
    ) -> None:
        super().__init__(scheduler_config, cache_config, num_blocks)
        self.kv_connector = connector
        self.num_kv_load_failures = 0  # requests recomputed after a failed load (logged)
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)  # vLLM's counter
        self._lookup: dict[str, tuple[int, int]] = {}  # req_id -> (local hit, external)
        self._external: dict[str, int] = {}  # req_id -> its tokens counted as loaded
        # P2P: requests waiting for their prompt's KV (WAITING_FOR_REMOTE_KVS), and those of
        # them whose grammar is compiling too (held for it once their KV came)
        self._remote = connector if isinstance(connector, P2pScheduler) else None
        self._receiving: set[str] = set()
        self._grammar_too: set[str] = set()

    def add_request(self, req: EngineCoreRequest) -> None:
        super().add_request(req)
        if self._remote is not None and self._remote.request_added(self.requests[req.request_id]):
            self._receiving.add(req.request_id)
            self.set_waiting_for_remote_kvs(req.request_id)

    def set_waiting_for_grammar(self, req_id: str) -> None:
        if req_id in self._receiving:
            self._grammar_too.add(req_id)
        else:
            super().set_waiting_for_grammar(req_id)

    def grammar_ready(self, req_id: str) -> None:
        self._grammar_too.discard(req_id)
        super().grammar_ready(req_id)

    def _received(self) -> None:
        """Requests whose transfer ended wait no more for it (vLLM's finished receives)."""
        assert self._remote is not None
        for req_id in self._remote.finished_recving():
            if req_id not in self._receiving:
                continue  # finished meanwhile
            self._receiving.discard(req_id)
            self.remote_kvs_ready(req_id)
            if req_id in self._grammar_too:
                self._grammar_too.discard(req_id)
                super().set_waiting_for_grammar(req_id)

    def _num_external_tokens(self, request: Request, num_hit: int) -> int:
        num_external = self.kv_connector.get_num_new_matched_tokens(request, num_hit)
        self._lookup[request.request_id] = (num_hit, num_external)
        return num_external

    def schedule(self, busy: Collection[str] = (), max_reqs: int = 0) -> SchedulerOutput:
        if self._receiving:
            self._received()
        out = super().schedule(busy, max_reqs)
        for new in out.scheduled_new_reqs:
            request = self.requests[new.req_id]
            self.kv_connector.update_state_after_alloc(request, new.block_ids)
            self._count_prompt_sources(request)
        self._lookup.clear()
        out.kv_connector_step = self.kv_connector.build_connector_meta(
            out, self.requests.__getitem__, self.kv_cache_manager.get_block_ids
        )
        return out

    def _count_prompt_sources(self, request: Request) -> None:
        """A request's prompt tokens by source, at its first admission (vLLM counts each
        request once; a preempted one admitted again is not counted again)."""
        local, external = self._lookup.get(request.request_id, (0, 0))
        if request.request_id in self._external:
            return
        self._external[request.request_id] = external
        counts = self.prompt_tokens_by_source
        counts["local_cache_hit"] += local
        counts["external_kv_transfer"] += external
        counts["local_compute"] += request.num_prompt_tokens - local - external

    def recompute_failed_loads(self, failed: dict[str, str]) -> None:
        """vLLM's kv_load_failure_policy "recompute": a request whose load failed in the
        worker (its step ran without it) goes back to what is valid, its local prefix hit,
        and the next steps compute the rest; it is not loaded again. Its blocks stay: the
        failed ones are not in the prefix cache (only computed blocks are registered)."""
        for req_id, why in failed.items():
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted meanwhile
            valid = self.kv_connector.load_failed(req_id)
            self.num_kv_load_failures += 1
            logger.warning(
                "request %s: KV load failed (%s); recomputing its tokens from %d "
                "(%d load failures so far)",
                req_id,
                why,
                valid,
                self.num_kv_load_failures,
            )
            request.num_computed_tokens = valid
            request.num_cached_tokens = valid
            external = self._external.get(req_id, 0)  # computed after all
            self._external[req_id] = 0
            self.prompt_tokens_by_source["external_kv_transfer"] -= external
            self.prompt_tokens_by_source["local_compute"] += external

    def kv_transfer_seconds(self, seconds: list[float]) -> None:
        """The offload tier's [loads, stores] seconds of a step, over every rank."""
        if isinstance(self.kv_connector, OffloadScheduler):
            transfers = self.kv_connector.transfers
            transfers.loads.seconds += seconds[0]
            transfers.stores.seconds += seconds[1]

    def _finish(self, request: Request, reason: FinishReason) -> None:
        super()._finish(request, reason)
        self.kv_connector.request_finished(request.request_id)
        self._receiving.discard(request.request_id)
        self._grammar_too.discard(request.request_id)
        self._external.pop(request.request_id, None)

    def close(self) -> None:
        """The engine stops: the connector's listeners and threads go (the P2P connector's)."""
        if self._remote is not None:
            self._remote.close()

    def get_stats(self) -> SchedulerStats:
        stats = super().get_stats()
        queries, hits = self.kv_connector.prefix_cache_stats()
        stats.external_prefix_cache_queries = queries
        stats.external_prefix_cache_hits = hits
        stats.prompt_tokens_by_source = dict(self.prompt_tokens_by_source)
        if isinstance(self.kv_connector, OffloadScheduler):
            stats.kv_offload = copy.deepcopy(self.kv_connector.transfers)
        return stats


class ConnectorScheduler(ConnectorSteps, Scheduler):
    """The Python twin with a KV connector."""


def connector_scheduler_cls(twin: type[Scheduler]) -> type[ConnectorSteps]:
    """``twin`` (``get_scheduler_cls()``: the native scheduler when built and enabled, else
    the Python one) with the connector's steps."""
    if twin is Scheduler:
        return ConnectorScheduler

    class NativeConnectorScheduler(ConnectorSteps, twin):  # type: ignore[valid-type,misc]
        """The native twin with a KV connector."""

    return NativeConnectorScheduler


def connector_scheduler(config: TrillmConfig, num_blocks: int) -> ConnectorSteps:
    cls = connector_scheduler_cls(get_scheduler_cls())
    logger.info("KV connector: the %s scheduler runs", cls.__name__)
    kv, offload = config.kv_transfer, config.kv_offload
    connector: KVConnectorScheduler
    if offload is not None:  # --kv-offloading-size (refused with --kv-transfer-config)
        connector = OffloadScheduler(
            offload.num_blocks, config.cache.block_size, offload.rank_block_bytes
        )
    else:
        assert kv is not None  # the caller checked
        block_size, world_size = config.cache.block_size, config.parallel.world_size
        if kv.p2p is not None:
            identity, split = p2p_identity(config)
            connector = P2pScheduler(kv, identity, block_size, world_size, split)
        else:
            connector = SharedStorageScheduler(kv, cache_identity(config), block_size, world_size)
    return cls(config.scheduler, config.cache, num_blocks, connector)
