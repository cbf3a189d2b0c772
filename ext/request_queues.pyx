# distutils: language = c++
"""The native scheduler's queues: trillm._ext.request_queues (ext/scheduler.pyx's waiting and
running queues; the Python twin, trillm/core/scheduler.py, keeps lists and bisect).

A queue is a vector of borrowed pointers to the scheduler's request records (every queued
record is in the scheduler's ``requests`` dict, and leaves the queues before it leaves that
dict). The waiting queue is in arrival order (fcfs), or sorted by (priority, arrival) under the
priority policy; the running queue is in admission order.
"""

from cpython.ref cimport PyObject
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

from trillm._ext.kv_cache_manager cimport (
    ST_WAITING_FOR_GRAMMAR,
    ST_WAITING_FOR_REMOTE_KVS,
    Request,
)


cdef size_t index_of(vector[PyObject*]& queue, Request r) except? 0:
    cdef size_t i
    for i in range(queue.size()):
        if queue[i] == <PyObject*>r:
            return i
    raise ValueError(f"{r.request_id!r} is not in the queue")


cdef void remove_from(vector[PyObject*]& queue, Request r) except *:
    queue.erase(queue.begin() + index_of(queue, r))


cdef inline cbool _key_greater(Request a, Request b):
    """(priority, arrival_time) of a > that of b."""
    if a.priority != b.priority:
        return a.priority > b.priority
    return a.arrival_time > b.arrival_time


cdef void enqueue_waiting(vector[PyObject*]& waiting, Request r, cbool front,
                          cbool by_priority):
    """``front``: a preempted request, ahead of the requests of its (priority, arrival)."""
    cdef size_t i, n = waiting.size()
    cdef Request other
    if not by_priority:
        if front:
            waiting.insert(waiting.begin(), <PyObject*>r)
        else:
            waiting.push_back(<PyObject*>r)
        return
    # Sorted by (priority, arrival): bisect_left when front, bisect_right otherwise.
    i = 0
    while i < n:
        other = <Request>waiting[i]
        if front and not _key_greater(r, other):
            break
        if not front and _key_greater(other, r):
            break
        i += 1
    waiting.insert(waiting.begin() + i, <PyObject*>r)


cdef Py_ssize_t next_admissible(vector[PyObject*]& waiting):
    """Index of the first waiting request not waiting for its grammar or its remote KV,
    or -1."""
    cdef size_t i
    cdef int status
    for i in range(waiting.size()):
        status = (<Request>waiting[i]).status_
        if status != ST_WAITING_FOR_GRAMMAR and status != ST_WAITING_FOR_REMOTE_KVS:
            return <Py_ssize_t>i
    return -1


cdef Request pick_victim(vector[PyObject*]& running, object busy, cbool by_priority):
    """The running request to preempt: the newest (fcfs), or the one of the greatest
    (priority, arrival); never a request of ``busy`` (the one that needs room is not busy:
    always a candidate)."""
    cdef Py_ssize_t i, last = <Py_ssize_t>running.size() - 1
    cdef Request victim
    cdef Request r
    cdef cbool any_busy = bool(busy)
    while any_busy and (<Request>running[last]).request_id in busy:
        last -= 1
    victim = <Request>running[last]
    if not by_priority:
        return victim
    for i in range(last, -1, -1):
        r = <Request>running[i]
        if any_busy and r.request_id in busy:
            continue
        if _key_greater(r, victim):
            victim = r
    return victim
