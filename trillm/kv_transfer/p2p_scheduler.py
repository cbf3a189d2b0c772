"""The P2P connector's scheduler side (``base.KVConnectorScheduler``): the shared-storage
connector's, with the prompt's KV received off the steps instead of read from a file.

A decode instance (kv_consumer) hands each new request whose id names a listed prefill
instance (``p2p.PrefillAddresses``) to its ``Receiver`` (``request_added`` -> True: the
scheduler holds the request in WAITING_FOR_REMOTE_KVS); once the transfer ended
(``finished_recving``) the request is admitted as any other, its prompt's whole blocks loaded
from the received bytes when they arrived (the load carries them to the worker), computed when
they did not. A prefill instance (kv_producer) saves each computed prompt as the
shared-storage producer does; its worker keeps it for the decode instance to fetch ("GET"),
or pushes it to the decode instance the request id names if its operator lists it ("PUT",
"PUT_ASYNC"), whose engine core holds it (``p2p_push.PushPool``) until the request comes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trillm.core.request import Request
from trillm.kv_transfer.config import KVTransferConfig
from trillm.kv_transfer.p2p import PrefillAddresses, share_mismatch
from trillm.kv_transfer.p2p_push import PushPool, PushServer
from trillm.kv_transfer.p2p_recv import Receiver
from trillm.kv_transfer.shared_storage import SharedStorageScheduler
from trillm.messages import KVConnectorStep, SchedulerOutput

logger = logging.getLogger(__name__)


class P2pScheduler(SharedStorageScheduler):
    """``identity``: the cache identity without the split (``p2p.p2p_identity``), which keys
    the transfers; ``split``: this instance's (the shares' identities name it); one share per
    rank of ``world_size`` (a decode instance listens on ``kv_port + rank`` for each, in the
    push modes)."""

    def __init__(
        self,
        kv: KVTransferConfig,
        identity: str,
        block_size: int,
        world_size: int = 1,
        split: str = "tp1.pp1",
    ) -> None:
        super().__init__(kv, identity, block_size, world_size)
        p2p = kv.p2p
        assert p2p is not None
        self.split = split
        self._door = PrefillAddresses(p2p.prefill_kv_addrs)
        # a pushing producer's door: the decode instances it may push to
        self._push_to = PrefillAddresses(p2p.decode_kv_addrs, decode=True)
        self.receiver: Receiver | None = None
        self.push_servers: list[PushServer] = []
        if kv.is_consumer:
            pool = None
            if p2p.pushes:
                senders = frozenset(a.rsplit(":", 1)[0] for a in p2p.prefill_kv_addrs)
                pool = PushPool(p2p.receive_bytes, senders)
                try:
                    for rank in range(world_size):  # NOTE: rank r's shares on kv_port + r
                        server = PushServer(pool, p2p.kv_ip, p2p.kv_port + rank, rank)
                        self.push_servers.append(server)
                        logger.info(
                            "P2P KV push receiver of rank %d on %s:%d", rank, *server.address
                        )
                except ValueError:
                    self.close()
                    raise
            self.receiver = Receiver(p2p.receive_bytes, pool, world_size, self._check)

    def _check(self, data: bytes, rank: int) -> str | None:
        return share_mismatch(data, self.identity, self.split, rank)

    def close(self) -> None:
        """The engine stops: the push listeners' ports are free and the connector's threads
        gone once this returns."""
        for server in self.push_servers:
            server.close()
        if self.receiver is not None:
            self.receiver.close()

    def request_added(self, request: Request) -> bool:
        """A new request -> True when it waits for its prompt's KV (a transfer started)."""
        if self.receiver is None or request.skip_prefix_lookup:
            return False
        key, n = self._prefix(request)
        if n == 0:
            return False  # no whole block before its last token: nothing to move
        found = self._door.lookup(request.request_id, key)
        return found is not None and self.receiver.want(request.request_id, found)

    def finished_recving(self) -> list[str]:
        """The requests whose transfer ended since the last step (vLLM's get_finished)."""
        return [] if self.receiver is None else self.receiver.finished()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        rid = request.request_id
        if self.receiver is None or request.skip_prefix_lookup or rid in self._not_loaded:
            return 0  # NOTE: prompt logprobs need every prompt position computed
        key, n = self._prefix(request)
        self._lookups[rid] = (key, 0, num_computed_tokens)
        if n <= num_computed_tokens or not self.receiver.has(rid):
            return 0  # nothing arrived (not asked, failed, or taken before a preemption)
        self._lookups[rid] = (key, n, num_computed_tokens)
        return n - num_computed_tokens

    def update_state_after_alloc(self, request: Request, block_ids: list[int]) -> None:
        super().update_state_after_alloc(request, block_ids)
        loads = self._loads
        if self.receiver is not None and loads and loads[-1].req_id == request.request_id:
            loads[-1].data = self.receiver.take(request.request_id)

    def build_connector_meta(
        self,
        out: SchedulerOutput,
        request_of: Callable[[str], Request],
        block_ids_of: Callable[[str], list[int]],
    ) -> KVConnectorStep:
        step = super().build_connector_meta(out, request_of, block_ids_of)
        assert self.kv.p2p is not None
        if self.kv.is_producer and self.kv.p2p.pushes and step.saves:
            saves = []
            for item in step.saves:  # pushed to the listed decode instance the id names
                to = self._push_to.lookup(item.req_id, item.key)
                if to is not None:
                    item.key = to
                    saves.append(item)
            step.saves = saves
        return step

    def request_finished(self, req_id: str) -> None:
        super().request_finished(req_id)
        if self.receiver is not None:
            self.receiver.forget(req_id)
