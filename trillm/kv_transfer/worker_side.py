"""The worker side of the engine's KV connector: the offload tier's (``--kv-offloading-size``),
the shared-storage connector's (``--kv-transfer-config``), or a no-op without either; on one
of several ranks (tensor x pipeline), with its failed loads agreed over every rank
(``rank_agreement.py``)."""

from __future__ import annotations

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
        connector = OffloadWorker(config.kv_offload, rank)
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
