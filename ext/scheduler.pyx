# distutils: language = c++
"""Native scheduler: trillm._ext.scheduler (twin: trillm/core/scheduler.py).

Same API, same decisions, same SchedulerOutput messages as the Python twin (a differential test
compares them). The request records, block tables, block pool, free queue and hash map are C++
state (trillm._ext.kv_cache_manager, cimported: one compiled copy); the scheduling loops run on
typed records. Its parts, each a module cimported through its .pxd (as the twin's are
modules): ext/request_queues.pyx (the waiting and running queues: vectors of the records),
ext/step_plan.pyx (what one schedule() hands out, as a SchedulerOutput), ext/step_outputs.pyx
(P4 per request: sampled tokens appended, finish rules, the EngineCoreOutput). The messages
are the Python dataclasses of trillm.messages.
"""

from cpython.ref cimport PyObject
from cython.operator cimport dereference as cython_deref
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

from trillm._ext.kv_cache_manager cimport (
    ST_PREEMPTED,
    ST_RUNNING,
    ST_WAITING,
    ST_WAITING_FOR_GRAMMAR,
    ST_WAITING_FOR_REMOTE_KVS,
    KVCacheManager,
    Request,
    cache_written_tokens,
)
from trillm._ext.request_queues cimport (
    enqueue_waiting,
    index_of,
    next_admissible,
    pick_victim,
    remove_from,
)
from trillm._ext.step_outputs cimport NOT_FINISHED, append_sampled, finish_reason, make_output
from trillm._ext.step_plan cimport StepPlan

from trillm.core.errors import DuplicateRequestError
from trillm.core.request import finished_status
from trillm.core.request_fits import check_request_fits
from trillm.messages import FinishReason, SchedulerStats


cdef long long _clamp_to_spans(long long num_computed, long long n, list spans):
    """trillm.core.mm_spans.clamp_to_spans: ``n`` tokens from ``num_computed``, cut so that the
    chunk does not end inside an image's span (it ends at the span's start, or takes 0)."""
    cdef long long end = num_computed + n, start, stop
    for start, stop in spans:
        if start < end < stop:
            return start - num_computed if start > num_computed else 0
    return n


cdef class Scheduler:
    """P1 (schedule) and P4 (update_from_output) of EngineCore.step(); see the Python twin."""

    cdef readonly object scheduler_config
    cdef readonly object cache_config
    cdef readonly KVCacheManager kv_cache_manager
    cdef readonly long long max_num_seqs
    cdef readonly long long max_num_batched_tokens
    cdef readonly long long max_model_len
    cdef readonly long long long_prefill_token_threshold
    cdef readonly cbool priority_policy
    cdef readonly dict requests  # req_id -> Request: owns every live record
    # NOTE: the queues hold borrowed pointers: every queued Request is in self.requests, and
    # leaves the queues before it leaves that dict.
    cdef vector[PyObject*] waiting  # head = next to admit
    cdef vector[PyObject*] running  # in admission order
    cdef list _finished_req_ids
    cdef long long _step_id
    cdef public long long num_preemptions
    cdef object _busy  # schedule()'s argument, for its helpers
    # Image spans a prefill chunk may not end inside (trillm/core/mm_spans.py; Gemma 3)
    cdef public cbool keep_mm_spans_whole
    cdef dict _mm_spans  # req_id -> [(start, stop)], only requests with images
    # The encoder budget and cache of a multimodal model (trillm/core/encoder_cache.py, one
    # object for both twins), else None
    cdef public object encoder_cache

    def __init__(self, scheduler_config, cache_config, int num_blocks):
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
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests = {}
        self._finished_req_ids = []
        self._step_id = 0
        self.num_preemptions = 0
        self._busy = ()
        self.keep_mm_spans_whole = False
        self._mm_spans = {}
        self.encoder_cache = None

    # ------------------------------------------------------------------ requests in

    def add_request(self, req):
        if req.request_id in self.requests:
            raise DuplicateRequestError(f"Request id {req.request_id!r} is already in use.")
        check_request_fits(req, self.max_model_len, self.kv_cache_manager.num_blocks,
                           self.kv_cache_manager.block_size)
        cdef Request r = Request.from_engine_core_request(req)
        self.requests[r.request_id] = r
        if self.keep_mm_spans_whole and req.mm_items:
            self._mm_spans[r.request_id] = [(m.offset, m.offset + m.length) for m in req.mm_items]
        if self.encoder_cache is not None and req.mm_items:
            self.encoder_cache.add_request(r.request_id, req.mm_items)
        self._enqueue_waiting(r, False)

    cdef void _enqueue_waiting(self, Request r, cbool front):
        enqueue_waiting(self.waiting, r, front, self.priority_policy)

    def set_waiting_for_grammar(self, str req_id):
        """A waiting request's grammar is still compiling: not admitted until grammar_ready
        (the requests behind it are)."""
        cdef Request r = self.requests.get(req_id)
        if r is not None and r.status_ == ST_WAITING:
            r.status_ = ST_WAITING_FOR_GRAMMAR

    def grammar_ready(self, str req_id):
        cdef Request r = self.requests.get(req_id)
        if r is not None and r.status_ == ST_WAITING_FOR_GRAMMAR:
            r.status_ = ST_WAITING

    def set_waiting_for_remote_kvs(self, str req_id):
        """A waiting request's prompt KV is being received off the steps (a KV connector's
        asynchronous load): not admitted until remote_kvs_ready (the requests behind it are)."""
        cdef Request r = self.requests.get(req_id)
        if r is not None and r.status_ == ST_WAITING:
            r.status_ = ST_WAITING_FOR_REMOTE_KVS

    def remote_kvs_ready(self, str req_id):
        cdef Request r = self.requests.get(req_id)
        if r is not None and r.status_ == ST_WAITING_FOR_REMOTE_KVS:
            r.status_ = ST_WAITING

    def update_draft_token_ids(self, dict draft_token_ids):
        """Speculative decoding seam: drafts to verify at the next step."""
        cdef Request r
        for req_id, drafts in draft_token_ids.items():
            r = self.requests.get(req_id)
            if r is not None and r.status_ == ST_RUNNING:
                r.spec_token_ids = drafts

    # ------------------------------------------------------------------ P1: schedule

    def schedule(self, busy=(), long long max_reqs=0):
        """``busy``: the requests of the steps still in flight (skipped, never preempted);
        ``max_reqs`` > 0: the most requests this step may hold."""
        self._step_id += 1
        cdef StepPlan plan = StepPlan(self.max_num_batched_tokens, max_reqs)
        cdef long long preemptions_before = self.num_preemptions
        self._busy = busy
        if self.encoder_cache is not None:
            self.encoder_cache.new_step()
        self._schedule_running(plan)
        if self.num_preemptions == preemptions_before:
            # NOTE: after a preemption nothing is admitted: blocks are short this step.
            self._schedule_waiting(plan)
        finished = self._finished_req_ids
        self._finished_req_ids = []
        out = plan.to_output(self._step_id, finished)
        if self.encoder_cache is not None:
            out.free_encoder_mm_hashes = self.encoder_cache.end_step()
        return out

    cdef inline long long _chunk_size(self, Request r, long long num_computed,
                                      long long num_tokens, long long budget) except? -1:
        cdef long long n = num_tokens - num_computed
        if budget < n:
            n = budget
        if self.long_prefill_token_threshold > 0 and self.long_prefill_token_threshold < n:
            n = self.long_prefill_token_threshold
        if self.max_model_len - num_computed < n:
            n = self.max_model_len - num_computed
        if self._mm_spans:
            spans = self._mm_spans.get(r.request_id)
            if spans is not None:
                n = _clamp_to_spans(num_computed, n, spans)
        if self.encoder_cache is not None and n > 0:  # NOTE: last: it holds what n reaches
            n = self.encoder_cache.cut(r.request_id, num_computed, n)
        return n

    cdef void _schedule_running(self, StepPlan plan) except *:
        cdef KVCacheManager kv = self.kv_cache_manager
        cdef size_t i = 0, num_running
        cdef Request r
        cdef long long n
        cdef vector[int] no_blocks
        cdef vector[int] new_blocks
        while i < self.running.size() and plan.has_room():
            r = <Request>self.running[i]
            if self._busy and r.request_id in self._busy:
                i += 1
                continue
            n = self._chunk_size(r, r.num_computed_tokens,
                                 <long long>(r.tokens.size() + r.spec.size()), plan.budget)
            if n <= 0:
                self._unschedule_items(r)
                i += 1
                continue
            num_running = self.running.size()
            if not self._make_room(r, n, plan):
                continue  # it preempted itself: running[i] is now the next request
            if self.running.size() != num_running:
                i = index_of(self.running, r)  # a victim ahead of it may have gone
            kv._allocate(r, n, no_blocks, False, new_blocks)
            plan.add_cached(r, n, [b for b in new_blocks])
            i += 1

    cdef cbool _make_room(self, Request r, long long n, StepPlan plan) except *:
        cdef vector[int] no_blocks
        cdef Request victim
        while not self.kv_cache_manager._can_allocate(r, n, no_blocks):
            victim = pick_victim(self.running, self._busy, self.priority_policy)
            self._preempt(victim, plan)
            if victim is r:
                return False
        return True

    cdef void _preempt(self, Request r, StepPlan plan) except *:
        remove_from(self.running, r)
        plan.unschedule(r)
        self._unschedule_items(r)
        if self.encoder_cache is not None:
            self.encoder_cache.free_request(r.request_id)
        self.kv_cache_manager.free(r)
        r.status_ = ST_PREEMPTED
        r.num_computed_tokens = 0
        r.spec.clear()
        self.num_preemptions += 1
        if r.sent_to_worker:
            self._finished_req_ids.append(r.request_id)
            r.sent_to_worker = False
        self._enqueue_waiting(r, True)

    cdef void _schedule_waiting(self, StepPlan plan) except *:
        cdef KVCacheManager kv = self.kv_cache_manager
        cdef Request r
        cdef vector[int] computed
        cdef vector[int] new_blocks
        cdef long long num_hit, num_external, n
        cdef Py_ssize_t head
        while (self.waiting.size() > 0 and plan.has_room()
               and <long long>self.running.size() < self.max_num_seqs):
            head = next_admissible(self.waiting)
            if head < 0:
                break  # only requests waiting for their grammar or remote KV
            r = <Request>self.waiting[head]
            num_hit = kv._lookup(r, computed)
            num_external = self._num_external_tokens(r, num_hit)
            num_hit += num_external
            n = self._chunk_size(r, num_hit, <long long>r.tokens.size(), plan.budget)
            if n <= 0 or not kv._can_allocate(r, num_external + n, computed):
                self._unschedule_items(r)
                break  # NOTE: strict queue order: nothing overtakes the head
            kv._allocate(r, num_external + n, computed, True, new_blocks)
            self.waiting.erase(self.waiting.begin() + head)
            r.num_computed_tokens = num_hit
            if not r.has_num_cached:
                r.has_num_cached = True
                r.num_cached_ = num_hit
            r.status_ = ST_RUNNING
            r.sent_to_worker = True
            self.running.push_back(<PyObject*>r)
            plan.add_new(r, n)

    cpdef long long _num_external_tokens(self, Request r, long long num_hit) except? -1:
        """Prompt tokens after the local hits a KV connector loads: none here; the connector
        scheduler (trillm/kv_transfer/scheduler_side.py) overrides it, on either twin."""
        return 0

    cdef void _unschedule_items(self, Request r) except *:
        """What _chunk_size took in the encoder cache for a request left out this step."""
        if self.encoder_cache is not None:
            self.encoder_cache.unschedule(r.request_id)

    # ------------------------------------------------------------------ P4: update

    def update_from_output(self, sched, out):
        outputs = []
        cdef Request r
        cdef int reason
        cdef long long stop_reason
        cdef Py_ssize_t num_new
        cdef long long written
        num_scheduled = sched.num_scheduled_tokens
        spec_decode = sched.scheduled_spec_decode_tokens
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            r = self.requests.get(req_id)
            if r is None or req_id not in num_scheduled:
                continue  # aborted since it was scheduled
            drafts = spec_decode.get(req_id) if spec_decode else None
            if drafts and sampled:
                r.num_computed_tokens -= len(drafts) + 1 - len(sampled)
            r.spec.clear()
            stop_reason = -1
            num_new = 0
            reason = append_sampled(r, sampled, self.max_model_len, &num_new, &stop_reason)
            self.kv_cache_manager.cache_full_blocks(r)
            written = 0 if r.cache_writes_sent else cache_written_tokens(self.kv_cache_manager, r)
            if reason != NOT_FINISHED:
                self._finish(r, finish_reason(reason))
            output = make_output(r, sampled, num_new, reason, stop_reason, out, written)
            if output is not None:
                outputs.append(output)
        return outputs

    # ------------------------------------------------------------------ finishing

    def finish_requests(self, req_ids, reason):
        """Remove requests (abort, or a stop string found by the output side) at once."""
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        reason = FinishReason(reason)
        cdef Request r
        for req_id in req_ids:
            r = self.requests.get(req_id)
            if r is not None:
                self._finish(r, reason)

    cpdef void _finish(self, Request r, object reason) except *:
        # NOTE: cpdef: the connector scheduler extends it (the connector forgets the request)
        if r.status_ == ST_RUNNING:
            remove_from(self.running, r)
        else:
            remove_from(self.waiting, r)
        r.status_ = <int>finished_status(reason)
        self.kv_cache_manager.free(r)
        del self.requests[r.request_id]
        self._mm_spans.pop(r.request_id, None)
        if self.encoder_cache is not None:
            self.encoder_cache.remove_request(r.request_id)
        if r.sent_to_worker:
            self._finished_req_ids.append(r.request_id)
            r.sent_to_worker = False

    # ------------------------------------------------------------------ stats

    @property
    def num_running(self):
        return self.running.size()

    @property
    def num_waiting(self):
        return self.waiting.size()

    def get_request_counts(self):
        """(num_running, num_waiting)."""
        return self.running.size(), self.waiting.size()

    def has_unfinished_requests(self):
        return self.running.size() > 0 or self.waiting.size() > 0

    def get_request(self, req_id):
        return self.requests.get(req_id)

    def running_req_ids(self):
        return [(<Request>p).request_id for p in self.running]

    def waiting_req_ids(self):
        return [(<Request>p).request_id for p in self.waiting]

    def reset_prefix_cache(self):
        self.kv_cache_manager.reset_prefix_cache()

    def preempt_running(self):
        """Every running request back to the waiting queue's head, its blocks freed, its
        tokens to be computed again (sleep mode discards the KV cache) -> the ids the workers
        hold, for the caller to drop there now: no later step reports them finished (a step
        never lists a request both finished and new)."""
        cdef StepPlan plan = StepPlan(0)
        cdef Request r
        cdef list held = []
        while self.running.size():
            r = <Request>self.running.back()  # the newest first: the oldest ends first
            if r.sent_to_worker:
                held.append(r.request_id)
            self._preempt(r, plan)
        for req_id in held:
            self._finished_req_ids.remove(req_id)
        return held

    def get_stats(self):
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=self.running.size(),
            num_waiting_reqs=self.waiting.size(),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )
