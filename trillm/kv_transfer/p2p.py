"""vLLM's ``P2pNcclConnector`` between a prefill and a decode instance, over TCP here
(``p2p_wire.py``), in vLLM's "GET" mode: the prefill instance (kv_producer) keeps each computed
prompt's KV blocks in a store bounded by ``kv_buffer_size`` and serves them on
``kv_ip:kv_port``; the decode instance (kv_consumer) pulls them before the request's first
step instead of computing them.

As in vLLM, the proxy tells the decode instance where a prompt's KV is in the request id:
``___prefill_addr_<ip>:<port>___decode_addr_<ip>:<port>_<uuid>`` (``disagg_proxy
--prefill-kv-addr``). A client can set the request id, so the decode instance fetches only
from the addresses its operator lists (``prefill_kv_addrs``, ``PrefillAddresses``). The
scheduler side (``SharedStorageScheduler`` with ``kv.p2p``) claims the prompt's whole blocks
for a request whose id names a listed prefill address; the worker side fetches them. A fetch that fails (no server, dropped, over the deadline, evicted, damaged,
another model's) is a failed load: the scheduler recomputes those tokens.

The same two sides take NIXL or NCCL on a GPU: ``fetch`` is the one transport call.
"""

from __future__ import annotations

import logging
import math
import re
import time

import torch

from trillm.kv_transfer.config import KVTransferConfig
from trillm.kv_transfer.kv_blocks import gather, payload_bytes, scatter
from trillm.kv_transfer.p2p_config import PREFILL_KV_ADDRS, kv_address
from trillm.kv_transfer.p2p_wire import KVServer, SendStore, fetch
from trillm.kv_transfer.storage import HEADER_READ_BYTES, pack, unpack
from trillm.messages import KVConnectorStep, KVTransferItem

logger = logging.getLogger(__name__)

_PREFILL_ADDR = re.compile(r"___prefill_addr_(.+?):(\d{1,5})___")
_LOG_EVERY_S = 10.0  # the refused-address warning, at most this often
# NOTE: a prefill instance that let a fetch time out is not asked again for this long (its
# loads fail at once: recomputed), so a silent one stalls the steps once per period, not once
# per request
_SILENT_PAUSE_S = 10.0


def prefill_address(request_id: str) -> tuple[str, int] | None:
    match = _PREFILL_ADDR.search(request_id)
    if match is None:
        return None
    return match.group(1), int(match.group(2))


class PrefillAddresses:
    """The scheduler's door: a request id naming a prefill instance the operator did not list
    (``kv_connector_extra_config.prefill_kv_addrs``) is computed here; its address is never
    connected to. Refusals are counted and logged at most every ``_LOG_EVERY_S``."""

    def __init__(self, allowed: tuple[str, ...]) -> None:
        self.allowed = frozenset(allowed)
        self.refused = 0
        self._logged_at = -math.inf

    def lookup(self, request_id: str, key: str) -> str | None:
        """The load's key, ``<ip>:<port>/<prefix key>``; None when the request id names no
        prefill instance, or one not listed (the request is computed here)."""
        named = prefill_address(request_id)
        if named is None:
            return None
        address = kv_address(f"{named[0]}:{named[1]}")
        normal = None if address is None else f"{address[0]}:{address[1]}"
        if normal is None or normal not in self.allowed:
            self._refuse(request_id, f"{named[0]}:{named[1]}")
            return None
        return f"{normal}/{key}"

    def _refuse(self, request_id: str, named: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at < _LOG_EVERY_S:
            return
        self._logged_at = now
        logger.warning(
            "request %s names prefill KV address %s, not in kv_connector_extra_config.%s: "
            "computed here, not fetched (%d such requests so far)",
            request_id,
            named,
            PREFILL_KV_ADDRS,
            self.refused,
        )


class P2pWorker:
    """The worker side (``base.KVConnectorWorker``)."""

    def __init__(self, identity: str, kv: KVTransferConfig) -> None:
        assert kv.p2p is not None
        self.identity = identity
        self.store: SendStore | None = None
        self.server: KVServer | None = None
        self._silent_until: dict[str, float] = {}  # address -> when it may be asked again
        if kv.is_producer:
            self.store = SendStore(kv.p2p.kv_buffer_size)
            self.server = KVServer(self.store, kv.p2p.kv_ip, kv.p2p.kv_port)
            logger.info("P2P KV server on %s:%d", *self.server.address)

    def start_load_kv(
        self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]
    ) -> dict[str, str]:
        failed = {}
        for item in () if step is None else step.loads:
            try:
                self._load(item, kv_caches)
            except (OSError, ValueError, RuntimeError) as exc:  # NOTE: that request's alone
                logger.warning("request %s: KV transfer failed: %s", item.req_id, exc)
                failed[item.req_id] = f"KV connector load: {exc}"
        return failed

    def wait_for_save(self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]) -> None:
        if self.store is None:
            return
        for item in () if step is None else step.saves:
            header, payload = gather(item, kv_caches, self.identity)
            self.store.put(item.key, pack(header, payload))

    def _load(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        address, key = item.key.split("/", 1)
        host, port = address.rsplit(":", 1)
        limit = payload_bytes(item, kv_caches) + HEADER_READ_BYTES
        if time.monotonic() < self._silent_until.get(address, -math.inf):
            raise RuntimeError(f"the prefill instance at {address} timed out lately; not asked")
        try:
            blob = fetch(host, int(port), key, limit)
        except TimeoutError:
            self._silent_until[address] = time.monotonic() + _SILENT_PAUSE_S
            raise
        if blob is None:
            raise RuntimeError(f"the prefill instance at {address} does not hold this prompt")
        found = unpack(blob, self.identity, item.num_tokens)
        if found is None:
            raise RuntimeError(f"the KV from {address} is damaged or another model's")
        scatter(item, kv_caches, *found)
