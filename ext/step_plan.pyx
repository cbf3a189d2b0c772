# distutils: language = c++
"""P1's result: trillm._ext.step_plan (twin: trillm/core/step_plan.py).

The ``StepPlan`` one native ``Scheduler.schedule()`` call (ext/scheduler.pyx) builds request by
request (tokens per request, new and cached requests, draft tokens, the structured-output
count) and turns into the step's ``SchedulerOutput``.
"""

from libcpp cimport bool as cbool

from trillm._ext.kv_cache_manager cimport Request

from trillm.messages import CachedRequestData, NewRequestData, SchedulerOutput


cdef class StepPlan:
    """What one schedule() call hands out, built up request by request."""

    def __init__(self, long long budget, long long max_reqs=0):
        self.budget = budget
        self.max_reqs = max_reqs
        self.num_scheduled = {}
        self.new_reqs = []
        self.cached = {}
        self.spec = {}
        self.structured = 0

    cdef cbool has_room(self):
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
        """A request scheduled earlier in this step was preempted: give its tokens back."""
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
