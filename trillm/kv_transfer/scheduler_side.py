"""The scheduler with a KV connector: the Python twin (``core/scheduler.py``) asking the
connector's scheduler side (``base.KVConnectorScheduler``) for a waiting request's external
tokens. The native scheduler has no such hook yet: an engine with ``--kv-transfer-config``
runs this one (``engine_cores.make_scheduler`` says so in its log)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from trillm.config import CacheConfig, SchedulerConfig, TrillmConfig
from trillm.core.request import Request
from trillm.core.scheduler import Scheduler
from trillm.kv_transfer.base import KVConnectorScheduler
from trillm.kv_transfer.shared_storage import SharedStorageScheduler
from trillm.kv_transfer.storage import cache_identity
from trillm.messages import FinishReason, SchedulerOutput, SchedulerStats

logger = logging.getLogger(__name__)


class ConnectorScheduler(Scheduler):
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

    def _num_external_tokens(self, request: Request, num_hit: int) -> int:
        return self.kv_connector.get_num_new_matched_tokens(request, num_hit)

    def schedule(self, busy: Collection[str] = (), max_reqs: int = 0) -> SchedulerOutput:
        out = super().schedule(busy, max_reqs)
        for new in out.scheduled_new_reqs:
            self.kv_connector.update_state_after_alloc(self.requests[new.req_id], new.block_ids)
        out.kv_connector_step = self.kv_connector.build_connector_meta(
            out, self.requests.__getitem__, self.kv_cache_manager.get_block_ids
        )
        return out

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

    def _finish(self, request: Request, reason: FinishReason) -> None:
        super()._finish(request, reason)
        self.kv_connector.request_finished(request.request_id)

    def get_stats(self) -> SchedulerStats:
        stats = super().get_stats()
        queries, hits = self.kv_connector.prefix_cache_stats()
        stats.external_prefix_cache_queries = queries
        stats.external_prefix_cache_hits = hits
        return stats


def connector_scheduler(config: TrillmConfig, num_blocks: int) -> ConnectorScheduler:
    kv = config.kv_transfer
    assert kv is not None  # the caller checked
    logger.info("KV connector: the Python scheduler runs (the native one has no connector hook)")
    connector = SharedStorageScheduler(kv, cache_identity(config), config.cache.block_size)
    return ConnectorScheduler(config.scheduler, config.cache, num_blocks, connector)
