# Declarations of ext/step_plan.pyx (trillm._ext.step_plan), cimported by ext/scheduler.pyx.

from libcpp cimport bool as cbool

from trillm._ext.kv_cache_manager cimport Request


cdef class StepPlan:
    cdef long long budget
    cdef long long max_reqs  # > 0: the most requests of the step
    cdef dict num_scheduled  # req_id -> num_scheduled_tokens
    cdef list new_reqs
    cdef dict cached  # req_id -> (new block ids, num_computed_tokens before this step)
    cdef dict spec  # req_id -> draft tokens scheduled
    cdef int structured

    cdef cbool has_room(self)
    cdef void _schedule(self, Request r, long long n)
    cdef void add_cached(self, Request r, long long n, list new_blocks)
    cdef void add_new(self, Request r, long long n)
    cdef void unschedule(self, Request r)
    cdef object to_output(self, long long step_id, list finished)
