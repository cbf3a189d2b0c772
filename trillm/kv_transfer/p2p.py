"""vLLM's ``P2pNcclConnector`` between a prefill and a decode instance, over TCP here
(``p2p_wire.py``), in vLLM's "GET" mode: the prefill instance (kv_producer) keeps each computed
prompt's KV blocks in a store bounded by ``kv_buffer_size`` and serves them on
``kv_ip:kv_port``; the decode instance (kv_consumer) pulls them before the request's first
step instead of computing them.

As in vLLM, the proxy tells the decode instance where a prompt's KV is in the request id:
``___prefill_addr_<ip>:<port>___decode_addr_<ip>:<port>_<uuid>`` (``disagg_proxy
--prefill-kv-addr``). A client can set the request id, so the decode instance fetches only
from the addresses its operator lists (``prefill_kv_addrs``, ``PrefillAddresses``). The
scheduler side (``p2p_scheduler.P2pScheduler``) has the engine core receive the prompt's whole
blocks off the steps (``p2p_recv.Receiver``) while the request waits, then loads them; the
worker side checks and scatters the bytes. A transfer that fails (no server, dropped, over
the deadline, evicted, damaged, another model's) is recomputed.

The same two sides take NIXL or NCCL on a GPU: ``p2p_wire.fetch`` is the one transport call.
"""

from __future__ import annotations

import logging
import math
import re
import time

import torch

from trillm.kv_transfer.base import BlockWorker
from trillm.kv_transfer.config import KVTransferConfig
from trillm.kv_transfer.kv_blocks import gather, payload_bytes, scatter
from trillm.kv_transfer.p2p_config import DECODE_KV_ADDRS, PREFILL_KV_ADDRS, kv_address
from trillm.kv_transfer.p2p_push import PUSH_QUEUE_BYTES, Pusher
from trillm.kv_transfer.p2p_wire import KVServer, SendStore
from trillm.kv_transfer.storage import HEADER_READ_BYTES, pack, unpack
from trillm.messages import KVTransferItem

logger = logging.getLogger(__name__)

_PREFILL_ADDR = re.compile(r"___prefill_addr_(.+?):(\d{1,5})___")
_DECODE_ADDR = re.compile(r"___decode_addr_(.+?):(\d{1,5})(?:_|$)")
_LOG_EVERY_S = 10.0  # the refused-address warning, at most this often


def prefill_address(request_id: str) -> tuple[str, int] | None:
    match = _PREFILL_ADDR.search(request_id)
    if match is None:
        return None
    return match.group(1), int(match.group(2))


class PrefillAddresses:
    """The scheduler's door: a request id naming a prefill instance the operator did not list
    (``kv_connector_extra_config.prefill_kv_addrs``) is computed here; its address is never
    connected to. Refusals are counted and logged at most every ``_LOG_EVERY_S``. With
    ``decode=True``, the same for the decode instance a pushing prefill instance sends to
    (``decode_kv_addrs``): a request naming one not listed pushes nothing."""

    def __init__(self, allowed: tuple[str, ...], decode: bool = False) -> None:
        self.allowed = frozenset(allowed)
        self.refused = 0
        self._logged_at = -math.inf
        self._pattern = _DECODE_ADDR if decode else _PREFILL_ADDR
        self._what = (
            ("decode", DECODE_KV_ADDRS, "not pushed")
            if decode
            else (
                "prefill",
                PREFILL_KV_ADDRS,
                "not fetched",
            )
        )

    def lookup(self, request_id: str, key: str) -> str | None:
        """The transfer's key, ``<ip>:<port>/<prefix key>``; None when the request id names no
        instance, or one not listed (the request is computed here, or not pushed)."""
        match = self._pattern.search(request_id)
        if match is None:
            return None
        named = f"{match.group(1)}:{match.group(2)}"
        address = kv_address(named)
        normal = None if address is None else f"{address[0]}:{address[1]}"
        if normal is None or normal not in self.allowed:
            self._refuse(request_id, named)
            return None
        return f"{normal}/{key}"

    def _refuse(self, request_id: str, named: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at < _LOG_EVERY_S:
            return
        self._logged_at = now
        what, key, done = self._what
        logger.warning(
            "request %s names %s KV address %s, not in kv_connector_extra_config.%s: "
            "computed here, %s (%d such requests so far)",
            request_id,
            what,
            named,
            key,
            done,
            self.refused,
        )


class P2pWorker(BlockWorker):
    """The worker side (``base.KVConnectorWorker``)."""

    what = "KV transfer"

    def __init__(self, identity: str, kv: KVTransferConfig) -> None:
        assert kv.p2p is not None
        self.identity = identity
        self.store: SendStore | None = None
        self.server: KVServer | None = None
        self.pusher: Pusher | None = None
        if kv.is_producer and kv.p2p.pushes:  # "PUT" / "PUT_ASYNC": to the decode instance
            self.pusher = Pusher(kv.p2p.send_type == "PUT_ASYNC", PUSH_QUEUE_BYTES)
        elif kv.is_producer:  # "GET": kept until the decode instance fetches it
            self.store = SendStore(kv.p2p.kv_buffer_size)
            self.server = KVServer(self.store, kv.p2p.kv_ip, kv.p2p.kv_port)
            logger.info("P2P KV server on %s:%d", *self.server.address)

    def _save(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        header, payload = gather(item, kv_caches, self.identity)
        if self.pusher is not None:  # the key names the (listed) decode instance
            address, key = item.key.rsplit("/", 1)
            self.pusher.send(address, key, pack(header, payload))
        elif self.store is not None:  # NOTE: a consumer's scheduler side asks no save
            self.store.put(item.key, pack(header, payload))

    def _load(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        """The bytes the engine core received for ``item`` (``p2p_recv.py``), checked."""
        if item.data is None:
            raise RuntimeError("no KV came with the load")
        if len(item.data) > payload_bytes(item, kv_caches) + HEADER_READ_BYTES:
            raise ValueError(f"{len(item.data)} bytes of KV, over this prompt's size")
        found = unpack(item.data, self.identity, item.num_tokens)
        if found is None:
            raise RuntimeError("the KV received is damaged or another model's")
        scatter(item, kv_caches, *found)
