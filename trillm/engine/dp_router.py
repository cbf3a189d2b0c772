"""Data parallelism: which engine core takes a new request, and which core holds each one.

Owned by the output handler (``output_handler.OutputHandler``), the one task that submits
requests and aborts, so its counts need no lock and are never stale: a core's load is the
engine requests the frontend sent it that have not finished (its waiting + running queues,
plus those still on their way), ties broken by its last reported KV-cache usage.

Prefix affinity: the prefix cache is per core, so requests that share a prefix gain from
running on the same core. A prompt with at least one full block is keyed by its first block
of tokens (with its cache salt and adapter keys, which the block hashes mix in too); the core
that last took that key takes the next request with it, unless that core has more than
``AFFINITY_SLACK`` engine requests in flight beyond the least-loaded one (then the key moves).

Also here: ``core_configs`` (one config per core) and ``sum_stats`` (the cores' stats as one).
"""

from __future__ import annotations

import copy
import os
import tempfile
import uuid
from collections import Counter, OrderedDict

from trillm.config import TrillmConfig
from trillm.messages import EngineCoreRequest, SchedulerStats, SpecDecodingStats

# Engine requests a preferred core may carry beyond the least-loaded one before a request
# sharing its prefix goes elsewhere: a cached first block saves one block of prefill, so a
# short queue is worth waiting in, a long one is not.
AFFINITY_SLACK = 8
# Prefix keys remembered (least recently used forgotten first).
MAX_PREFIX_KEYS = 4096


class DataParallelRouter:
    def __init__(self, num_engines: int, block_size: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}.")
        self.num_engines = num_engines
        self.block_size = block_size
        self.loads = [0] * num_engines  # engine requests in flight per core
        self.kv_usage = [0.0] * num_engines  # from each core's last SchedulerStats
        self.routed = [0] * num_engines  # engine requests each core was given (cumulative)
        self._owner: dict[str, int] = {}  # engine request id -> its core
        self._homes: OrderedDict[int, int] = OrderedDict()  # prefix key -> core

    def route(self, requests: list[EngineCoreRequest]) -> int:
        """The core for one user request's engine requests (its ``n`` samples stay together:
        they share the whole prompt)."""
        index = self._choose(requests[0]) if self.num_engines > 1 else 0
        for r in requests:
            self._owner[r.request_id] = index
        self.loads[index] += len(requests)
        self.routed[index] += len(requests)
        return index

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def release(self, request_id: str) -> int | None:
        """The request finished or was aborted: -> the core that held it (None if none)."""
        index = self._owner.pop(request_id, None)
        if index is not None:
            self.loads[index] -= 1
        return index

    def note_kv_usage(self, index: int, usage: float) -> None:
        self.kv_usage[index] = usage

    def _choose(self, request: EngineCoreRequest) -> int:
        least = min(range(self.num_engines), key=lambda i: (self.loads[i], self.kv_usage[i]))
        key = self._prefix_key(request)
        if key is None:
            return least
        home = self._homes.get(key)
        if home is None or self.loads[home] > self.loads[least] + AFFINITY_SLACK:
            home = least
        self._homes[key] = home
        self._homes.move_to_end(key)
        if len(self._homes) > MAX_PREFIX_KEYS:
            self._homes.popitem(last=False)
        return home

    def _prefix_key(self, request: EngineCoreRequest) -> int | None:
        """The first full block's key, None for a prompt shorter than one block (the prefix
        cache keeps full blocks only, so such prompts share nothing)."""
        tokens = request.prompt_token_ids
        if len(tokens) < self.block_size:
            return None
        salt = (request.cache_salt, *request.extra_hash_keys)
        return hash((salt, tuple(tokens[: self.block_size])))


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several engine cores' stats as one: counts summed, KV usage averaged (the cores have
    the same number of blocks)."""
    total = SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        num_deferred_waiting_reqs=sum(s.num_deferred_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        external_prefix_cache_queries=sum(s.external_prefix_cache_queries for s in stats),
        external_prefix_cache_hits=sum(s.external_prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        running_lora_adapters=_merged([s.running_lora_adapters for s in stats]),
        waiting_lora_adapters=_merged([s.waiting_lora_adapters for s in stats]),
    )
    specs = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    if specs:
        total.spec_decoding = SpecDecodingStats(
            sum(s.num_drafts for s in specs),
            sum(s.num_draft_tokens for s in specs),
            sum(s.num_accepted_tokens for s in specs),
            [sum(pos) for pos in zip(*(s.num_accepted_tokens_per_pos for s in specs))],
        )
    return total


def _merged(counts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(sorted(total.items()))


def core_configs(config: TrillmConfig) -> list[TrillmConfig]:
    """One config per engine core (data parallelism): each executor writes its own (the
    rendezvous port, the block count), and each core's workers know their core's index; with
    the experts spread over the cores (-dp N -ep) all of them name one rendezvous file."""
    size = config.parallel.data_parallel_size
    if size == 1:
        return [config]
    if config.parallel.experts_span_cores:  # every core's ranks meet at one file
        name = f"trillm-experts-{os.getpid()}-{uuid.uuid4().hex}"
        config.parallel.expert_store = os.path.join(tempfile.gettempdir(), name)
    configs = [copy.deepcopy(config) for _ in range(size)]
    for index, core_config in enumerate(configs):
        core_config.parallel.data_parallel_rank = index
    return configs
