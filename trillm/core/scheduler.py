"""The scheduler: P1 (``schedule``) and P4 (``update_from_output``) of ``EngineCore.step()``.

Pure-Python twin of ``ext/scheduler.pyx``; ``trillm._native.get_scheduler_cls()`` picks one.
Its parts: ``step_plan.py`` (what one ``schedule()`` hands out, as a ``SchedulerOutput``),
``step_outputs.py`` (P4 per request: sampled tokens appended, finish rules, the output).

No prefill/decode phases: every request has ``num_computed_tokens`` and ``num_tokens``; each
step hands out ``{req_id: n_tokens}`` under ``max_num_batched_tokens`` and ``max_num_seqs``,
RUNNING requests first (in admission order), then WAITING ones (FCFS, or by (priority,
arrival) under the priority policy). Prompts longer than the budget are chunked.
``num_computed_tokens`` advances at schedule time (as vLLM does); rejected draft tokens roll it
back in ``update_from_output``. When a running request needs a block and none is free, the
lowest-priority running request is preempted (recompute): its blocks are freed and it goes
back to the front of the waiting queue, to be sent to the worker in full again later.

With pipeline parallelism the engine core keeps several steps in flight (its batch queue) and
passes their requests as ``schedule(busy=...)``: a busy request is neither scheduled again nor
preempted until its step's output is applied, so in-flight steps hold disjoint requests; and
``max_reqs`` caps the requests of one step (its share of them), so that the next step has
some to run.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable

from trillm.config import CacheConfig, SchedulerConfig
from trillm.core.encoder_cache import EncoderCache
from trillm.core.errors import DuplicateRequestError
from trillm.core.kv_cache_manager import KVCacheManager
from trillm.core.mm_spans import clamp_to_spans
from trillm.core.request import Request, RequestStatus, finished_status
from trillm.core.request_fits import check_request_fits
from trillm.core.step_outputs import append_sampled, make_output
from trillm.core.step_plan import StepPlan
from trillm.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)

# Waiting requests that are not admitted yet (nor hold back the requests behind them)
_HELD = (RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS)


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        if scheduler_config.policy not in ("fcfs", "priority"):
            raise ValueError(f"Unknown scheduling policy {scheduler_config.policy!r}.")
        self.priority_policy = scheduler_config.policy == "priority"
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self._waiting: list[Request] = []  # head = next to admit
        self._running: list[Request] = []  # in admission order
        # Finished, aborted or preempted since the last schedule(), known to the worker.
        self._finished_req_ids: list[str] = []
        self._step_id = 0
        self.num_preemptions = 0
        self._busy: Collection[str] = ()  # schedule()'s argument, for its helpers
        # Image spans a prefill chunk may not end inside (mm_spans.py; Gemma 3), by request
        self.keep_mm_spans_whole = False
        self._mm_spans: dict[str, list[tuple[int, int]]] = {}
        # The encoder budget and cache of a multimodal model (encoder_cache.py), else None
        self.encoder_cache: EncoderCache | None = None

    # ------------------------------------------------------------------ requests in

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.requests:
            raise DuplicateRequestError(f"Request id {req.request_id!r} is already in use.")
        kv = self.kv_cache_manager
        check_request_fits(req, self.max_model_len, kv.num_blocks, kv.block_size)
        request = Request.from_engine_core_request(req)
        self.requests[req.request_id] = request
        if self.keep_mm_spans_whole and req.mm_items:
            self._mm_spans[req.request_id] = [(m.offset, m.offset + m.length) for m in req.mm_items]
        if self.encoder_cache is not None and req.mm_items:
            self.encoder_cache.add_request(req.request_id, req.mm_items)
        self._enqueue_waiting(request, front=False)

    def _waiting_key(self, request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        """FCFS: append (or push to the front after a preemption). Priority: keep the queue
        sorted by (priority, arrival); a preempted request goes first among its equals."""
        if not self.priority_policy:
            if front:
                self._waiting.insert(0, request)
            else:
                self._waiting.append(request)
            return
        keys = [self._waiting_key(r) for r in self._waiting]
        insort = bisect.bisect_left if front else bisect.bisect_right
        self._waiting.insert(insort(keys, self._waiting_key(request)), request)

    def set_waiting_for_grammar(self, req_id: str) -> None:
        """A waiting request's grammar is still compiling: it keeps its place in the queue
        but is not admitted (nor does it hold back the requests behind it) until
        ``grammar_ready``."""
        request = self.requests.get(req_id)
        if request is not None and request.status == RequestStatus.WAITING:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR

    def grammar_ready(self, req_id: str) -> None:
        request = self.requests.get(req_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            request.status = RequestStatus.WAITING

    def set_waiting_for_remote_kvs(self, req_id: str) -> None:
        """A waiting request's prompt KV is being received off the steps (a KV connector's
        asynchronous load): not admitted until ``remote_kvs_ready`` (the requests behind it
        are)."""
        request = self.requests.get(req_id)
        if request is not None and request.status == RequestStatus.WAITING:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def remote_kvs_ready(self, req_id: str) -> None:
        request = self.requests.get(req_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            request.status = RequestStatus.WAITING

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Speculative decoding seam: drafts to verify at the next step."""
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = list(drafts)

    # ------------------------------------------------------------------ P1: schedule

    def schedule(self, busy: Collection[str] = (), max_reqs: int = 0) -> SchedulerOutput:
        """``busy``: the requests of the steps still in flight (skipped, never preempted);
        ``max_reqs`` > 0: the most requests this step may hold."""
        self._step_id += 1
        plan = StepPlan(self.max_num_batched_tokens, max_reqs)
        preemptions_before = self.num_preemptions
        self._busy = busy
        if self.encoder_cache is not None:
            self.encoder_cache.new_step()
        self._schedule_running(plan)
        if self.num_preemptions == preemptions_before:
            # NOTE: after a preemption nothing is admitted: blocks are short this step.
            self._schedule_waiting(plan)
        finished, self._finished_req_ids = self._finished_req_ids, []
        out = plan.to_output(self._step_id, finished)
        if self.encoder_cache is not None:
            out.free_encoder_mm_hashes = self.encoder_cache.end_step()
        return out

    def _chunk_size(self, request: Request, num_computed: int, num_tokens: int, budget: int) -> int:
        n = min(num_tokens - num_computed, budget)
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        n = min(n, self.max_model_len - num_computed)
        spans = self._mm_spans.get(request.request_id) if self._mm_spans else None
        if spans is not None:
            n = clamp_to_spans(num_computed, n, spans)
        if self.encoder_cache is not None and n > 0:  # NOTE: last: it holds what n reaches
            n = self.encoder_cache.cut(request.request_id, num_computed, n)
        return n

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests in admission order; preempts when blocks run out."""
        i = 0
        while i < len(self._running) and plan.has_room:
            request = self._running[i]
            if self._busy and request.request_id in self._busy:
                i += 1
                continue
            n = self._chunk_size(
                request, request.num_computed_tokens, request.num_tokens_with_spec, plan.budget
            )
            if n <= 0:
                self._unschedule_items(request)
                i += 1
                continue
            num_running = len(self._running)
            if not self._make_room(request, n, plan):
                continue  # it preempted itself: running[i] is now the next request
            if len(self._running) != num_running:
                i = self._running.index(request)  # a victim ahead of it may have gone
            plan.add_cached(request, n, self.kv_cache_manager.allocate_slots(request, n))
            i += 1

    def _make_room(self, request: Request, n: int, plan: StepPlan) -> bool:
        """Preempt until ``request`` can get blocks for ``n`` tokens -> False when the victim
        was ``request`` itself."""
        while not self.kv_cache_manager.can_allocate(request, n):
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _pick_victim(self) -> Request:
        """FCFS: the newest running request. Priority: the largest priority value, then the
        latest arrival, then the latest admitted. Never a busy one (the request that needs
        room is not busy, so there is always a candidate)."""
        candidates = self._running
        if self._busy:
            candidates = [r for r in self._running if r.request_id not in self._busy]
        victim = candidates[-1]
        if not self.priority_policy:
            return victim
        for request in reversed(candidates):
            if self._waiting_key(request) > self._waiting_key(victim):
                victim = request
        return victim

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self._running.remove(request)
        plan.unschedule(request)
        self._unschedule_items(request)
        if self.encoder_cache is not None:
            self.encoder_cache.free_request(request.request_id)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.num_preemptions += 1
        if request.sent_to_worker:
            self._finished_req_ids.append(request.request_id)
            request.sent_to_worker = False
        self._enqueue_waiting(request, front=True)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        kv = self.kv_cache_manager
        while self._waiting and plan.has_room and len(self._running) < self.max_num_seqs:
            head = self._next_admissible()
            if head < 0:
                break  # only requests waiting for their grammar or remote KV
            request = self._waiting[head]
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            num_hit += (num_external := self._num_external_tokens(request, num_hit))
            n = self._chunk_size(request, num_hit, request.num_tokens, plan.budget)
            if n <= 0 or not kv.can_allocate(request, num_external + n, computed_blocks):
                self._unschedule_items(request)
                break  # NOTE: strict queue order: nothing overtakes the head
            kv.allocate_slots(request, num_external + n, computed_blocks)
            self._waiting.pop(head)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.sent_to_worker = True
            self._running.append(request)
            plan.add_new(request, n, kv.get_block_ids(request.request_id))

    def _num_external_tokens(self, request: Request, num_hit: int) -> int:
        """Prompt tokens after the local hits a KV connector loads (kv_transfer/); none here."""
        return 0

    def _unschedule_items(self, request: Request) -> None:
        """What ``_chunk_size`` took in the encoder cache for a request left out this step."""
        if self.encoder_cache is not None:
            self.encoder_cache.unschedule(request.request_id)

    def _next_admissible(self) -> int:
        """Index of the first waiting request not waiting for its grammar or its remote KV,
        or -1."""
        for i, request in enumerate(self._waiting):
            if request.status not in _HELD:
                return i
        return -1

    # ------------------------------------------------------------------ P4: update

    def update_from_output(
        self, sched: SchedulerOutput, out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or req_id not in sched.num_scheduled_tokens:
                continue  # aborted since it was scheduled
            drafts = sched.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled:
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
            request.spec_token_ids = []
            new_tokens, reason, stop_reason = append_sampled(request, sampled, self.max_model_len)
            self.kv_cache_manager.cache_full_blocks(request)
            written = 0  # read before _finish frees the blocks
            if not request.cache_writes_sent:
                written = self.kv_cache_manager.num_cache_written_tokens(request)
            if reason is not None:
                self._finish(request, reason)
            output = make_output(request, new_tokens, reason, stop_reason, out, written)
            if output is not None:
                outputs.append(output)
        return outputs

    # ------------------------------------------------------------------ finishing

    def finish_requests(self, req_ids: str | Iterable[str], reason: FinishReason) -> None:
        """Remove requests (abort, or a stop string found by the output side) at once."""
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, FinishReason(reason))

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        request.status = finished_status(reason)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._mm_spans.pop(request.request_id, None)
        if self.encoder_cache is not None:
            self.encoder_cache.remove_request(request.request_id)
        if request.sent_to_worker:
            self._finished_req_ids.append(request.request_id)
            request.sent_to_worker = False

    # ------------------------------------------------------------------ stats

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting)."""
        return len(self._running), len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def running_req_ids(self) -> list[str]:
        return [r.request_id for r in self._running]

    def waiting_req_ids(self) -> list[str]:
        return [r.request_id for r in self._waiting]

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    def preempt_running(self) -> list[str]:
        """Every running request back to the waiting queue's head, its blocks freed, its
        tokens to be computed again (sleep mode discards the KV cache) -> the ids the workers
        hold, for the caller to drop there now: no later step reports them finished (a step
        never lists a request both finished and new)."""
        plan = StepPlan(0)  # nothing is scheduled: the preemptions give no budget back
        held = []
        for request in list(reversed(self._running)):  # the newest first: the oldest ends first
            if request.sent_to_worker:
                held.append(request.request_id)
            self._preempt(request, plan)
        for req_id in held:
            self._finished_req_ids.remove(req_id)
        return held

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )
