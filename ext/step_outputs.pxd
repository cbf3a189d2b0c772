# Declarations of ext/step_outputs.pyx (trillm._ext.step_outputs), cimported by
# ext/scheduler.pyx.

from libc.stdint cimport int64_t

from trillm._ext.kv_cache_manager cimport Request

cdef enum:
    NOT_FINISHED = -1
    REASON_STOP = 0
    REASON_LENGTH = 1

cdef object finish_reason(int reason)
cdef int append_sampled(Request r, object sampled, long long max_model_len,
                        Py_ssize_t* num_new, long long* stop_reason) except? -2
cdef object make_output(Request r, object sampled, Py_ssize_t num_new, int reason,
                        long long stop_reason, object out, long long written)
