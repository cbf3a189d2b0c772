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

Tensor and pipeline parallelism (vLLM's pairing): each rank of the prefill instance keeps and
sends its own share of a prompt's KV (its KV heads, its stage's layers), rank ``r`` on
``kv_port + r`` of the addresses the request id names (``rank_address``); the decode instance
receives every rank's share before it loads any (``p2p_recv.Receiver``) and its rank ``r``
scatters share ``r``. A share's identity names the instance's split (``share_identity``), so
a prefill instance of another split is told apart from another model (``share_mismatch``) and
its KV recomputed, never loaded.

The same two sides take NIXL or NCCL on a GPU: ``p2p_wire.fetch`` is the one transport call.
"""

from __future__ import annotations

import logging
import re

import torch

from trillm.config import TrillmConfig
from trillm.kv_transfer.base import BlockWorker
from trillm.kv_transfer.config import KVTransferConfig
from trillm.kv_transfer.kv_blocks import gather, payload_bytes, scatter
from trillm.kv_transfer.log_every import EveryWarning
from trillm.kv_transfer.p2p_config import DECODE_KV_ADDRS, P2P_NCCL, PREFILL_KV_ADDRS, kv_address
from trillm.kv_transfer.p2p_push import PUSH_QUEUE_BYTES, Pusher
from trillm.kv_transfer.p2p_wire import KVServer, SendStore
from trillm.kv_transfer.storage import HEADER_READ_BYTES, cache_identity, header_of, pack, unpack
from trillm.messages import KVTransferItem

logger = logging.getLogger(__name__)

_PREFILL_ADDR = re.compile(r"___prefill_addr_(.+?):(\d{1,5})___")
_DECODE_ADDR = re.compile(r"___decode_addr_(.+?):(\d{1,5})(?:_|$)")


def split_name(tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """An instance's split of the KV over its ranks, as its shares' identities name it."""
    return f"tp{tensor_parallel_size}.pp{pipeline_parallel_size}"


def p2p_identity(config: TrillmConfig) -> tuple[str, str]:
    """(the cache identity without the split: the transfer keys' and the shares', the split's
    name)."""
    parallel = config.parallel
    split = split_name(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    return cache_identity(config, split=False), split


def share_identity(identity: str, split: str, rank: int) -> str:
    """The identity rank ``rank``'s share of a prompt's KV carries."""
    return f"{identity}/{split}/rank{rank}"


def share_mismatch(data: bytes, identity: str, split: str, rank: int) -> str | None:
    """Why rank ``rank`` of this instance cannot load ``data`` (its header alone read), None
    when its identity is this rank's: another split is named as such, so the operator learns
    that both instances need the same ``-tp`` and ``-pp``."""
    header = header_of(data)
    if header is None:
        return "the KV received has no header (damaged)"
    if header.identity == share_identity(identity, split, rank):
        return None
    parts = header.identity.split("/")
    if len(parts) == 3 and parts[0] == identity:
        return (
            f"the prefill instance's KV is split {_words(parts[1])}, this instance's "
            f"{_words(split)}: {P2P_NCCL} pairs the two instances' ranks by number, so both "
            "need the same tensor and pipeline parallel sizes"
        )
    return "the KV received is another model's or cache layout's"


def _words(split: str) -> str:
    tp, pp = split.removeprefix("tp").split(".pp")
    return f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}"


def rank_address(address: str, rank: int) -> str:
    """``ip:port`` -> rank ``rank``'s, ``ip:(port + rank)`` (vLLM's port offset)."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


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
        self._warning = EveryWarning(logger, "such requests")

    @property
    def refused(self) -> int:
        return self._warning.count

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
            what, listed, done = self._what
            self._warning.warn(
                "request %s names %s KV address %s, not in kv_connector_extra_config.%s: "
                "computed here, %s",
                request_id,
                what,
                named,
                listed,
                done,
            )
            return None
        return f"{normal}/{key}"


class P2pWorker(BlockWorker):
    """The worker side (``base.KVConnectorWorker``) on global rank ``rank``: its share of each
    prompt's KV, kept on (GET) or pushed to (PUT, PUT_ASYNC) ``kv_port + rank``, and share
    ``rank`` of what the engine core received loaded."""

    what = "KV transfer"

    def __init__(self, config: TrillmConfig, kv: KVTransferConfig, rank: int = 0) -> None:
        assert kv.p2p is not None
        identity, split = p2p_identity(config)
        self.rank = rank
        self.identity = share_identity(identity, split, rank)
        self.store: SendStore | None = None
        self.server: KVServer | None = None
        self.pusher: Pusher | None = None
        if kv.is_producer and kv.p2p.pushes:  # "PUT" / "PUT_ASYNC": to the decode instance
            self.pusher = Pusher(kv.p2p.send_type == "PUT_ASYNC", PUSH_QUEUE_BYTES)
        elif kv.is_producer:  # "GET": kept until the decode instance fetches it
            self.store = SendStore(kv.p2p.kv_buffer_size)
            self.server = KVServer(self.store, kv.p2p.kv_ip, kv.p2p.kv_port + rank)
            logger.info("P2P KV server of rank %d on %s:%d", rank, *self.server.address)

    def _save(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        header, payload = gather(item, kv_caches, self.identity)
        if self.pusher is not None:  # the key names the (listed) decode instance
            address, key = item.key.rsplit("/", 1)
            self.pusher.send(rank_address(address, self.rank), key, pack(header, payload))
        elif self.store is not None:  # NOTE: a consumer's scheduler side asks no save
            self.store.put(item.key, pack(header, payload))

    def _load(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        """This rank's share of the bytes the engine core received for ``item``
        (``p2p_recv.py``), checked."""
        if item.data is None or len(item.data) <= self.rank:
            raise RuntimeError("no KV came with the load")
        data = item.data[self.rank]
        if len(data) > payload_bytes(item, kv_caches) + HEADER_READ_BYTES:
            raise ValueError(f"{len(data)} bytes of KV, over this prompt's size")
        found = unpack(data, self.identity, item.num_tokens)
        if found is None:
            raise RuntimeError("the KV received is damaged or another model's")
        scatter(item, kv_caches, *found)
