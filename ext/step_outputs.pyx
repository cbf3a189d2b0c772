# distutils: language = c++
"""P4, per request: trillm._ext.step_outputs (twin: trillm/core/step_outputs.py).

A step's sampled tokens appended, the finish rules (length, EOS, stop token ids) checked after
each, and the request's ``EngineCoreOutput`` built; used by the native
``Scheduler.update_from_output`` (ext/scheduler.pyx). A finish is an int here (``REASON_*``
in ext/step_outputs.pxd, ``NOT_FINISHED``), ``finish_reason`` its ``FinishReason``.
"""

from libc.stdint cimport int64_t

from trillm._ext.kv_cache_manager cimport Request

from trillm.messages import EngineCoreOutput, FinishReason

_FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH)


cdef object finish_reason(int reason):
    return _FINISH_REASONS[reason]


cdef int append_sampled(Request r, object sampled, long long max_model_len,
                        Py_ssize_t* num_new, long long* stop_reason) except? -2:
    """Append ``sampled`` up to the token that finishes the request -> its finish (or
    NOT_FINISHED); ``num_new[0]``: the tokens appended, ``stop_reason[0]``: the stop token id
    (left as it is when none)."""
    cdef int reason = NOT_FINISHED
    for token in sampled:
        r.tokens.push_back(<int64_t>token)
        num_new[0] += 1
        reason = _check_stop(r, <int64_t>token, max_model_len, stop_reason)
        if reason != NOT_FINISHED:
            break
    return reason


cdef int _check_stop(Request r, int64_t token, long long max_model_len,
                     long long* stop_reason):
    cdef long long num_output = <long long>r.tokens.size() - r.num_prompt
    cdef size_t i
    if <long long>r.tokens.size() >= max_model_len or (
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


cdef object make_output(Request r, object sampled, Py_ssize_t num_new, int reason,
                        long long stop_reason, object out, long long written):
    """The request's output of the step (None: nothing new). ``written``: the prompt tokens in
    the request's cached blocks before any finish freed them (cache_written_tokens), reported
    with its first token or its finish."""
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
