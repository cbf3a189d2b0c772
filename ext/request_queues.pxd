# Declarations of ext/request_queues.pyx (trillm._ext.request_queues), cimported by
# ext/scheduler.pyx.

from cpython.ref cimport PyObject
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

from trillm._ext.kv_cache_manager cimport Request

cdef size_t index_of(vector[PyObject*]& queue, Request r) except? 0
cdef void remove_from(vector[PyObject*]& queue, Request r) except *
cdef void enqueue_waiting(vector[PyObject*]& waiting, Request r, cbool front,
                          cbool by_priority)
cdef Py_ssize_t next_admissible(vector[PyObject*]& waiting)
cdef Request pick_victim(vector[PyObject*]& running, object busy, cbool by_priority)
