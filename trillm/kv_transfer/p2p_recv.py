"""The decode instance's (kv_consumer's) receiving side of the P2P connector, in the engine
core and off its steps (vLLM's asynchronous load: ``get_num_new_matched_tokens`` answers
load_async, the request waits in WAITING_FOR_REMOTE_KVS, ``get_finished`` reports the finished
receives).

A request whose id names a listed prefill instance is handed to ``Receiver.want``: a thread
of a small pool fetches its prompt's KV (send_type "GET", ``p2p_wire.fetch``) while the
request waits and the steps of the others go on. ``finished`` names the requests whose
transfer ended, well or not; ``take`` gives the bytes of one that arrived (the scheduler puts
them in its load, and the worker checks and scatters them), None for one that failed, timed
out or was dropped: that request is computed here, never from partial KV.

The bytes received and not yet taken are bounded (``capacity``): a transfer that would pass it
fails (recomputed).

In the push modes (send_type "PUT" / "PUT_ASYNC", ``p2p_push.py``) nothing is fetched: ``want``
claims the prompt the prefill instance pushed, or waits for it at most ``PUSH_WAIT_S`` (a
"PUT_ASYNC" push may trail the prefill's answer); one that does not come is recomputed.

Tensor and pipeline parallelism: a request's transfer is every rank's share (rank ``r`` of the
prefill instance serves or pushes on ``port + r``), fetched one after the other; it arrived
only when each did and each share's header names this instance's rank and split (``check``:
``p2p.share_mismatch``), else it failed, whole: the prompt is computed on every rank.

A failed transfer is one warning line at most every 10 s (``log_every``), with the count.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from trillm.kv_transfer import p2p_wire
from trillm.kv_transfer.log_every import EveryWarning
from trillm.kv_transfer.p2p_push import PushPool

logger = logging.getLogger(__name__)

MAX_FETCHES = 4  # transfers at once; more wait for a thread (their requests keep waiting)
# NOTE: a prefill instance that let a fetch time out is not asked again for this long (those
# requests are computed at once), so a silent instance costs each request one deadline at most
SILENT_PAUSE_S = 10.0
PUSH_WAIT_S = 3.0  # how long a request waits for a push that has not come
# a closing receiver waits this long for its fetch threads (one still connecting takes up
# to p2p_wire.FIRST_BYTE_TIMEOUT_S; the others end at once)
CLOSE_JOIN_S = p2p_wire.FIRST_BYTE_TIMEOUT_S + 1.0

# (a share's bytes, its rank) -> why this instance's rank cannot load it; None: it can
ShareCheck = Callable[[bytes, int], "str | None"]


class Receiver:
    """Received prompts' KV (every rank's share), by request, waiting for their requests'
    admission."""

    def __init__(
        self,
        capacity: int,
        pushes: PushPool | None = None,
        world_size: int = 1,
        check: ShareCheck | None = None,
    ) -> None:
        self.capacity = capacity
        self.pushes = pushes
        self.world_size = world_size
        self.check = check
        self._awaited: dict[str, tuple[str, float]] = {}  # push modes: req_id -> (key, until)
        self._warning = EveryWarning(logger, "transfer failures")
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # req_ids whose transfer runs or waits for a thread
        self._arrived: dict[str, list[bytes]] = {}  # req_id -> its shares, not taken yet
        self._bytes = 0
        self._finished: list[str] = []  # since the last ``finished``
        self._silent_until: dict[str, float] = {}  # address -> when it may be asked again
        self._pool = ThreadPoolExecutor(MAX_FETCHES, thread_name_prefix="trillm-kv-p2p-fetch")
        self._fetches = p2p_wire.Fetches()  # the running fetches' connections
        if pushes is not None:
            pushes.on_arrival = self._pushed

    @property
    def failures(self) -> int:
        """Transfers that failed, timed out or did not fit (each recomputed)."""
        return self._warning.count

    def want(self, req_id: str, key: str) -> bool:
        """Starts fetching ``key`` (``<ip>:<port>/<prefix key>``) for ``req_id`` -> False when
        it is not fetched (its instance timed out lately): the request is computed at once."""
        address = key.split("/", 1)[0]
        if self.pushes is not None:
            return self._await_push(req_id, key.split("/", 1)[1])
        if time.monotonic() < self._silent_until.get(address, -math.inf):
            self._fail(req_id, f"the prefill instance at {address} timed out lately; not asked")
            return False
        with self._lock:
            self._pending.add(req_id)
        self._pool.submit(self._fetch, req_id, key)
        return True

    def finished(self) -> list[str]:
        """The requests whose transfer ended since the last call (vLLM's finished receives)."""
        if self._awaited:
            self._expire_waits()
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def _mismatch(self, shares: dict[int, bytes]) -> str | None:
        for rank, blob in sorted(shares.items()):
            why = None if self.check is None else self.check(blob, rank)
            if why is not None:
                return why
        return None

    def _await_push(self, req_id: str, key: str) -> bool:
        pushes = self.pushes
        assert pushes is not None
        with self._lock:
            blobs = pushes.claim_all(key, self.world_size)
            if blobs is None:
                came = {r: b for r in range(self.world_size) if (b := pushes.peek(key, r))}
                why = self._mismatch(came)
                if why is None:
                    self._pending.add(req_id)
                    self._awaited[req_id] = (key, time.monotonic() + PUSH_WAIT_S)
                    return True
            else:  # pushed already: loaded at its admission, if each share is this rank's
                why = self._mismatch(dict(enumerate(blobs)))
                if why is None:
                    self._arrived[req_id] = blobs
                    self._bytes += sum(map(len, blobs))
                    return False
        self._fail(req_id, why)
        return False

    def _pushed(self, key: str, rank: int) -> None:
        """A share came (a push server's thread): the request waiting for it takes the
        prompt's shares once each came, or fails at once if this one is not its rank's."""
        pushes = self.pushes
        assert pushes is not None
        with self._lock:
            waiting = [r for r, (k, _) in self._awaited.items() if k == key]
            if not waiting:
                return  # kept in the pool for a request still to come
            share = pushes.peek(key, rank)
            why = None if share is None else self._mismatch({rank: share})
            blobs = None if why is not None else pushes.claim_all(key, self.world_size)
            if why is None and blobs is None:
                return  # another rank's share is still to come
            req_id = waiting[0]
            del self._awaited[req_id]
            self._pending.discard(req_id)
            self._finished.append(req_id)
            if blobs is not None:
                self._arrived[req_id] = blobs
                self._bytes += sum(map(len, blobs))
        if why is not None:
            self._fail(req_id, why)

    def _expire_waits(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [r for r, (_, until) in self._awaited.items() if until <= now]
            for req_id in late:
                del self._awaited[req_id]
                self._pending.discard(req_id)
                self._finished.append(req_id)
        for req_id in late:
            self._fail(req_id, f"no push came within {PUSH_WAIT_S:g} s")

    def take(self, req_id: str) -> list[bytes] | None:
        """``req_id``'s shares (one per rank), None when none arrived."""
        with self._lock:
            blobs = self._arrived.pop(req_id, None)
            self._bytes -= 0 if blobs is None else sum(map(len, blobs))
        return blobs

    def has(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._arrived

    def forget(self, req_id: str) -> None:
        """``req_id`` finished or was aborted: its bytes go, a transfer still running is
        dropped when it ends."""
        with self._lock:
            self._pending.discard(req_id)
            self._awaited.pop(req_id, None)
        self.take(req_id)

    def close(self) -> None:
        """The engine stops: transfers not started are dropped, those running fail at once
        (their connections shut down; one still connecting within its connect timeout), and
        the fetch threads end with them: joined within ``CLOSE_JOIN_S`` in all."""
        with self._lock:
            self._pending.clear()
            self._awaited.clear()
        self._fetches.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        until = time.monotonic() + CLOSE_JOIN_S
        for thread in list(self._pool._threads):
            thread.join(max(0.0, until - time.monotonic()))

    def _fetch(self, req_id: str, key: str) -> None:
        address, prefix = key.split("/", 1)
        host, port = address.rsplit(":", 1)
        with self._lock:
            if req_id not in self._pending:
                return  # aborted while it waited for a thread
        blobs: list[bytes] = []
        try:
            for rank in range(self.world_size):  # NOTE: rank r's share on port + r (vLLM's)
                left = self.capacity - sum(map(len, blobs))
                blob = p2p_wire.fetch(host, int(port) + rank, prefix, left, self._fetches)
                if blob is None:
                    at = address if rank == 0 else f"{host}:{int(port) + rank} (rank {rank})"
                    raise RuntimeError(f"the prefill instance at {at} does not hold this prompt")
                why = self._mismatch({rank: blob})
                if why is not None:
                    raise ValueError(why)
                blobs.append(blob)
        except TimeoutError as exc:
            self._silent_until[address] = time.monotonic() + SILENT_PAUSE_S
            self._end(req_id, None, str(exc))
        except (OSError, ValueError, RuntimeError) as exc:
            self._end(req_id, None, str(exc))
        else:
            self._end(req_id, blobs, "")

    def _end(self, req_id: str, blobs: list[bytes] | None, why: str) -> None:
        with self._lock:
            if req_id not in self._pending:
                return  # aborted meanwhile: nobody waits for it
            self._pending.discard(req_id)
            size = 0 if blobs is None else sum(map(len, blobs))
            if blobs is not None and self._bytes + size > self.capacity:
                why = f"{size} bytes would pass the receive pool's bound"
                blobs = None
            if blobs is not None:
                self._arrived[req_id] = blobs
                self._bytes += size
            self._finished.append(req_id)
        if blobs is None:
            self._fail(req_id, why)

    def _fail(self, req_id: str, why: str) -> None:
        self._warning.warn(
            "request %s: KV transfer failed: %s; computing its prompt here",
            req_id,
            why,
        )
