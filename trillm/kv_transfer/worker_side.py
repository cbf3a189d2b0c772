"""The worker side of the engine's KV connector: the offload tier's (``--kv-offloading-size``),
the shared-storage connector's (``--kv-transfer-config``), or a no-op without either; on one
of several ranks (tensor x pipeline), with its failed loads agreed over every rank
(``rank_agreement.py``)."""

from __future__ import annotations

import time

import torch

from trillm.config import TrillmConfig
from trillm.kv_transfer.base import KVConnectorWorker
from trillm.kv_transfer.offload_worker import OffloadWorker
from trillm.kv_transfer.rank_agreement import agree_on_failed_loads
from trillm.kv_transfer.shared_storage import worker_connector as shared_storage_connector
from trillm.messages import KVConnectorStep


def worker_connector(config: TrillmConfig, rank: int = 0) -> KVConnectorWorker:
    """The connector's worker side on global rank ``rank``."""
    connector: KVConnectorWorker
    if config.kv_offload is not None:
        connector = TimedTransfers(OffloadWorker(config.kv_offload, rank))
    else:
        connector = shared_storage_connector(config, rank)
    if config.parallel.world_size == 1:
        return connector
    return RanksAgree(connector, rank)


class RanksAgree:
    """``connector`` on one of several ranks: a load that failed on any rank failed on all."""

    def __init__(self, connector: KVConnectorWorker, rank: int) -> None:
        self.connector = connector
        self.rank = rank

    def start_load_kv(
        self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]
    ) -> dict[str, str]:
        failed = self.connector.start_load_kv(step, kv_caches)
        device = kv_caches[0].device if kv_caches else torch.device("cpu")
        return agree_on_failed_loads(step, failed, self.rank, device)

    def wait_for_save(self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]) -> None:
        self.connector.wait_for_save(step, kv_caches)

    def take_seconds(self) -> list[float]:
        return take_transfer_seconds(self.connector)


class TimedTransfers:
    """The offload tier's worker side, its copies timed: [loads, stores] seconds since the last
    ``take_seconds`` (vLLM's vllm:kv_offload_{load,store}_time, measured in its workers)."""

    def __init__(self, connector: KVConnectorWorker) -> None:
        self.connector = connector
        self.seconds = [0.0, 0.0]

    def start_load_kv(
        self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]
    ) -> dict[str, str]:
        start = time.perf_counter()
        failed = self.connector.start_load_kv(step, kv_caches)
        if step is not None and step.loads:
            self.seconds[0] += time.perf_counter() - start
        return failed

    def wait_for_save(self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        self.connector.wait_for_save(step, kv_caches)
        if step is not None and step.saves:
            self.seconds[1] += time.perf_counter() - start

    def take_seconds(self) -> list[float]:
        spent, self.seconds = self.seconds, [0.0, 0.0]
        return spent if any(spent) else []


def take_transfer_seconds(connector: KVConnectorWorker) -> list[float]:
    """[loads, stores] seconds of the offload tier's copies since the last call ([] for
    another connector, or when none ran)."""
    take = getattr(connector, "take_seconds", None)
    return [] if take is None else take()
