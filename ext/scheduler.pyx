# distutils: language = c++
"""Native scheduler: trillm._ext.scheduler (twin: trillm/core/scheduler.py).

Same API, same decisions, same SchedulerOutput messages as the Python twin (a differential test
compares them). The request records, block tables, block pool, free queue and hash map are C++
state (trillm._ext.kv_cache_manager, cimported: one compiled copy); the scheduling loops run on
typed records. The waiting/running queues are Python lists of those records, and the messages built at the end of a step are the
Python dataclasses of trillm.messages.
"""

from cpython.ref cimport PyObject
from cython.operator cimport dereference as cython_deref
from libc.stdint cimport int64_t
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

from trillm.core.errors import DuplicateRequestError
from trillm.core.request import finished_status
from trillm.core.request_fits import check_request_fits
from trillm.messages import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)

_FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH)

cdef enum:
    NOT_FINISHED = -1
    REASON_STOP = 0
    REASON_LENGTH = 1


cdef class _StepPlan:
    """What one schedule() call hands out, built up request by request."""

    cdef long long budget
    cdef long long max_reqs  # > 0: the most requests of the step
    cdef dict num_scheduled  # req_id -> num_scheduled_tokens
    cdef list new_reqs
    cdef dict cached  # req_id -> (new block ids, num_computed_tokens before this step)
    cdef dict spec  # req_id -> draft tokens scheduled
    cdef int structured

    def __init__(self, long long budget, long long max_reqs=0):
        self.budget = budget
        self.max_reqs = max_reqs
        self.num_scheduled = {}
        self.new_reqs = []
        self.cached = {}
        self.spec = {}
        self.structured = 0

    cdef inline cbool has_room(self):
        return self.budget > 0 and (self.max_reqs <= 0
                                    or <long long>len(self.num_scheduled) < self.max_reqs)

    cdef void _schedule(self, Request r, long long n):
        self.num_scheduled[r.request_id] = n
        self.budget -= n
        if r.structured:
            self.structured += 1
        r.num_computed_tokens += n

    cdef void add_cached(self, Request r, long long n, list new_blocks):
        cdef long long num_spec = r.num_computed_tokens + n - <long long>r.tokens.size()
        cdef long long i
        if num_spec > 0:
            self.spec[r.request_id] = [r.spec[i] for i in range(num_spec)]
        self.cached[r.request_id] = (new_blocks, r.num_computed_tokens)
        self._schedule(r, n)

    cdef void add_new(self, Request r, long long n):
        self.new_reqs.append(
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=list(r._prompt),
                output_token_ids=r.output_token_ids,
                sampling_params=r.sampling_params,
                block_ids=[b for b in r.block_ids],
                num_computed_tokens=r.num_computed_tokens,
            )
        )
        self._schedule(r, n)

    cdef void unschedule(self, Request r):
        n = self.num_scheduled.pop(r.request_id, None)
        if n is None:
            return
        self.budget += <long long>n
        self.cached.pop(r.request_id, None)
        self.spec.pop(r.request_id, None)
        if r.structured:
            self.structured -= 1

    cdef object to_output(self, long long step_id, list finished):
        cached = CachedRequestData()
        cdef long long total = 0
        for req_id, (blocks, computed) in self.cached.items():
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(blocks)
            cached.num_computed_tokens.append(computed)
        for n in self.num_scheduled.values():
            total += <long long>n
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=self.spec,
            finished_req_ids=finished,
            wait_for_bitmask=self.structured > 0,
        )


cdef size_t _index_of(vector[PyObject*]& queue, Request r) except? 0:
    cdef size_t i
    for i in range(queue.size()):
        if queue[i] == <PyObject*>r:
            return i
    raise ValueError(f"{r.request_id!r} is not in the queue")


cdef void _remove(vector[PyObject*]& queue, Request r) except *:
    queue.erase(queue.begin() + _index_of(queue, r))


cdef long long _clamp_to_spans(long long num_computed, long long n, list spans):
    """trillm.core.mm_spans.clamp_to_spans: ``n`` tokens from ``num_computed``, cut so that the
    chunk does not end inside an image's span (it ends at the span's start, or takes 0)."""
    cdef long long end = num_computed + n, start, stop
    for start, stop in spans:
        if start < end < stop:
            return start - num_computed if start > num_computed else 0
    return n


cdef inline cbool _key_greater(Request a, Request b):
    """(priority, arrival_time) of a > that of b."""
    if a.priority != b.priority:
        return a.priority > b.priority
    return a.arrival_time > b.arrival_time


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
        cdef size_t i, n = self.waiting.size()
        cdef Request other
        if not self.priority_policy:
            if front:
                self.waiting.insert(self.waiting.begin(), <PyObject*>r)
            else:
                self.waiting.push_back(<PyObject*>r)
            return
        # Sorted by (priority, arrival): bisect_left when front, bisect_right otherwise.
        i = 0
        while i < n:
            other = <Request>self.waiting[i]
            if front and not _key_greater(r, other):
                break
            if not front and _key_greater(other, r):
                break
            i += 1
        self.waiting.insert(self.waiting.begin() + i, <PyObject*>r)

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
        cdef _StepPlan plan = _StepPlan(self.max_num_batched_tokens, max_reqs)
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

    cdef void _schedule_running(self, _StepPlan plan) except *:
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
                i = _index_of(self.running, r)  # a victim ahead of it may have gone
            kv._allocate(r, n, no_blocks, False, new_blocks)
            plan.add_cached(r, n, [b for b in new_blocks])
            i += 1

    cdef cbool _make_room(self, Request r, long long n, _StepPlan plan) except *:
        cdef vector[int] no_blocks
        cdef Request victim
        while not self.kv_cache_manager._can_allocate(r, n, no_blocks):
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is r:
                return False
        return True

    cdef Request _pick_victim(self):
        """Never a busy request (the one that needs room is not busy: always a candidate)."""
        cdef Py_ssize_t i, last = <Py_ssize_t>self.running.size() - 1
        cdef Request victim
        cdef Request r
        cdef cbool any_busy = bool(self._busy)
        while any_busy and (<Request>self.running[last]).request_id in self._busy:
            last -= 1
        victim = <Request>self.running[last]
        if not self.priority_policy:
            return victim
        for i in range(last, -1, -1):
            r = <Request>self.running[i]
            if any_busy and r.request_id in self._busy:
                continue
            if _key_greater(r, victim):
                victim = r
        return victim

    cdef void _preempt(self, Request r, _StepPlan plan) except *:
        _remove(self.running, r)
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

    cdef void _schedule_waiting(self, _StepPlan plan) except *:
        cdef KVCacheManager kv = self.kv_cache_manager
        cdef Request r
        cdef vector[int] computed
        cdef vector[int] new_blocks
        cdef long long num_hit, num_external, n
        cdef Py_ssize_t head
        while (self.waiting.size() > 0 and plan.has_room()
               and <long long>self.running.size() < self.max_num_seqs):
            head = self._next_admissible()
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

    cdef Py_ssize_t _next_admissible(self):
        """Index of the first waiting request not waiting for its grammar or its remote KV,
        or -1."""
        cdef size_t i
        cdef int status
        for i in range(self.waiting.size()):
            status = (<Request>self.waiting[i]).status_
            if status != ST_WAITING_FOR_GRAMMAR and status != ST_WAITING_FOR_REMOTE_KVS:
                return <Py_ssize_t>i
        return -1

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
            reason = NOT_FINISHED
            stop_reason = -1
            num_new = 0
            for token in sampled:
                r.tokens.push_back(<int64_t>token)
                num_new += 1
                reason = self._check_stop(r, <int64_t>token, &stop_reason)
                if reason != NOT_FINISHED:
                    break
            self.kv_cache_manager.cache_full_blocks(r)
            written = 0 if r.cache_writes_sent else cache_written_tokens(self.kv_cache_manager, r)
            if reason != NOT_FINISHED:
                self._finish(r, _FINISH_REASONS[reason])
            output = self._make_output(r, sampled, num_new, reason, stop_reason, out, written)
            if output is not None:
                outputs.append(output)
        return outputs

    cdef int _check_stop(self, Request r, int64_t token, long long* stop_reason):
        cdef long long num_output = <long long>r.tokens.size() - r.num_prompt
        cdef size_t i
        if <long long>r.tokens.size() >= self.max_model_len or (
                r.has_max_tokens and num_output >= r.max_tokens_):
            return REASON_LENGTH
        if num_output < r.min_tokens:
            return NOT_FINISHED
        if not r.ignore_eos and r.has_eos and token == r.eos:
            return REASON_STOP
        for i in range(r.stop_ids.size()):
            if r.stop_ids[i] == token:
                stop_reason[0] = token
                return REASON_STOP
        return NOT_FINISHED

    cdef object _make_output(self, Request r, sampled, Py_ssize_t num_new, int reason,
                             long long stop_reason, out, long long written):
        """``written``: the prompt tokens in the request's cached blocks before any _finish
        freed them (cache_written_tokens), reported with its first token or its finish."""
        req_id = r.request_id
        prompt_logprobs = out.prompt_logprobs.get(req_id) if out.prompt_logprobs else None
        if num_new == 0 and reason == NOT_FINISHED and prompt_logprobs is None:
            return None
        cdef long long num_cached = 0, num_created = 0, num_cached_all
        if not r.first_output_sent:
            r.first_output_sent = True
            num_cached = r.num_cached_ if r.has_num_cached else 0
        if not r.cache_writes_sent and (num_new > 0 or reason != NOT_FINISHED):
            r.cache_writes_sent = True
            num_cached_all = r.num_cached_ if r.has_num_cached else 0
            num_created = written - num_cached_all if written > num_cached_all else 0
        # NOTE: positional (keywords cost ~3x here): the field order of EngineCoreOutput.
        return EngineCoreOutput(
            req_id,
            list(sampled[:num_new]) if num_new != len(sampled) else list(sampled),
            out.logprobs.get(req_id) if out.logprobs else None,
            prompt_logprobs,
            None if reason == NOT_FINISHED else _FINISH_REASONS[reason],
            stop_reason if stop_reason >= 0 else None,
            num_cached,
            num_created,
        )

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
            _remove(self.running, r)
        else:
            _remove(self.waiting, r)
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
        cdef _StepPlan plan = _StepPlan(0)
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
