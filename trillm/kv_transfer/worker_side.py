"""The worker side of the engine's KV connector: the offload tier's (``--kv-offloading-size``),
the shared-storage connector's (``--kv-transfer-config``), or a no-op without either."""

from __future__ import annotations

from trillm.config import TrillmConfig
from trillm.kv_transfer.base import KVConnectorWorker
from trillm.kv_transfer.offload_worker import OffloadWorker
from trillm.kv_transfer.shared_storage import worker_connector as shared_storage_connector


def worker_connector(config: TrillmConfig) -> KVConnectorWorker:
    if config.kv_offload is not None:
        return OffloadWorker(config.kv_offload)
    return shared_storage_connector(config)
