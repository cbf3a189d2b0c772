"""The scheduler with a KV connector: either scheduler twin (the native one when built and
enabled, else ``core/scheduler.py``) asking the connector's scheduler side
(``base.KVConnectorScheduler``) for a waiting request's external tokens. ``ConnectorSteps``
holds the connector's part once, for both twins: their admission calls
``_num_external_tokens`` and their finish ``_finish``, which it extends (the native twin
declares both ``cpdef`` so that a Python subclass can)."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from trillm._native import get_scheduler_cls
from trillm.config import CacheConfig, SchedulerConfig, TrillmConfig
from trillm.core.request import Request
from trillm.core.scheduler import Scheduler
from trillm.kv_transfer.base import KVConnectorScheduler
from trillm.kv_transfer.shared_storage import SharedStorageScheduler
from trillm.kv_transfer.storage import cache_identity
from trillm.messages import FinishReason, SchedulerOutput, SchedulerStats

logger = logging.getLogger(__name__)


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
    kv = config.kv_transfer
    assert kv is not None  # the caller checked
    cls = connector_scheduler_cls(get_scheduler_cls())
    logger.info("KV connector: the %s scheduler runs", cls.__name__)
    connector = SharedStorageScheduler(kv, cache_identity(config), config.cache.block_size)
    return cls(config.scheduler, config.cache, num_blocks, connector)
