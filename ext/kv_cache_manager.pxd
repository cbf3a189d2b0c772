# The native request record, 128-bit block hash and block pool (ext/kv_cache_manager.pyx),
# declared for the modules that cimport them (ext/scheduler.pyx): compiled once, in
# trillm._ext.kv_cache_manager, so both modules share one Request and one KVCacheManager type.
# Mirrors trillm/core/request.py and trillm/core/kv_cache_manager.py decision for decision.

from libc.stdint cimport uint64_t, int64_t
from libcpp cimport bool as cbool
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

cdef extern from *:
    """
    #include <cstdint>
    #include <functional>
    struct TrillmKey128 {
        uint64_t lo;
        uint64_t hi;
        bool operator==(const TrillmKey128 &o) const { return lo == o.lo && hi == o.hi; }
    };
    namespace std {
    template <> struct hash<TrillmKey128> {
        size_t operator()(const TrillmKey128 &k) const noexcept {
            return (size_t)(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ULL));
        }
    };
    }
    static inline uint64_t trillm_mix64(uint64_t x) {
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
        return x ^ (x >> 31);
    }
    static inline void trillm_hash_word(uint64_t *h1, uint64_t *h2, uint64_t v) {
        *h1 = trillm_mix64(*h1 ^ v);
        *h2 = trillm_mix64((*h2 + v) * 0xFF51AFD7ED558CCDULL);
    }
    /* Must equal trillm.core.kv_cache_manager.hash_block_tokens. */
    static TrillmKey128 trillm_hash_block(bool has_parent, TrillmKey128 parent,
                                          const int64_t *tokens, int n,
                                          const uint64_t *extra, int n_extra) {
        uint64_t lo = has_parent ? parent.lo : 0x243F6A8885A308D3ULL;
        uint64_t hi = has_parent ? parent.hi : 0x13198A2E03707344ULL;
        uint64_t h1 = trillm_mix64(lo ^ 0x9E3779B97F4A7C15ULL);
        uint64_t h2 = trillm_mix64(hi ^ 0xD6E8FEB86659FD93ULL);
        for (int i = 0; i < n; ++i) trillm_hash_word(&h1, &h2, (uint64_t)tokens[i]);
        trillm_hash_word(&h1, &h2, (1ULL << 63) | (uint64_t)n);
        for (int i = 0; i < n_extra; ++i) trillm_hash_word(&h1, &h2, extra[i]);
        trillm_hash_word(&h1, &h2, (uint64_t)n_extra);
        TrillmKey128 k; k.lo = h1; k.hi = h2;
        return k;
    }
    """
    cdef cppclass Key128 "TrillmKey128":
        uint64_t lo
        uint64_t hi
    Key128 hash_block "trillm_hash_block"(
        cbool has_parent, Key128 parent, const int64_t *tokens, int n,
        const uint64_t *extra, int n_extra) nogil

# Status codes: the values of trillm.core.request.RequestStatus.
cdef enum:
    ST_WAITING = 0
    ST_RUNNING = 1
    ST_PREEMPTED = 2
    ST_WAITING_FOR_GRAMMAR = 3
    ST_WAITING_FOR_REMOTE_KVS = 4
    ST_FINISHED_STOPPED = 5
    ST_FINISHED_LENGTH_CAPPED = 6
    ST_FINISHED_ABORTED = 7


cdef class Request:
    cdef readonly str request_id
    cdef list _prompt  # [num_prompt_tokens], kept as a list for NewRequestData
    cdef vector[int64_t] tokens  # prompt + output
    cdef int num_prompt
    cdef vector[int64_t] spec  # draft tokens (speculative decoding seam)
    cdef readonly object sampling_params
    cdef int64_t max_tokens_
    cdef cbool has_max_tokens
    cdef readonly int min_tokens
    cdef readonly cbool ignore_eos
    cdef vector[int64_t] stop_ids
    cdef int64_t eos
    cdef cbool has_eos
    cdef readonly long long priority
    cdef readonly double arrival_time
    cdef int status_
    cdef public long long num_computed_tokens
    cdef long long num_cached_
    cdef cbool has_num_cached
    cdef vector[Key128] hashes  # chain hashes of the full blocks, lazily extended
    cdef readonly object cache_salt
    cdef readonly list extra_hash_keys
    cdef vector[uint64_t] first_keys  # extra hash keys of the first block
    cdef vector[uint64_t] later_keys  # ... and of every later block
    cdef public cbool sent_to_worker
    cdef public cbool first_output_sent
    cdef public cbool cache_writes_sent  # its prefix-cache writes reported (first token/finish)
    cdef cbool structured
    cdef readonly cbool skip_prefix_lookup  # prompt logprobs need every position computed: no cache hits
    # Owned by the KV manager:
    cdef vector[int] block_ids
    cdef int num_cached_blocks
    cdef cbool has_table


cdef class KVCacheManager:
    cdef readonly int num_blocks
    cdef readonly int block_size
    cdef readonly cbool enable_prefix_caching
    cdef vector[int] ref_cnt
    # LRU free queue as an intrusive doubly linked list over block ids (head = next evicted).
    cdef vector[int] prev_
    cdef vector[int] next_
    cdef vector[char] in_free
    cdef int head
    cdef int tail
    cdef int nfree
    cdef vector[Key128] block_hash
    cdef vector[char] has_hash
    cdef vector[int64_t] block_tokens  # [num_blocks * block_size] tokens of hashed blocks
    cdef unordered_map[Key128, int] cached  # block hash -> block id
    cdef dict tables  # req_id -> Request holding a block table
    cdef public long long prefix_cache_queries
    cdef public long long prefix_cache_hits


    cdef int _lookup(self, Request r, vector[int]& out)
    cdef cbool _can_allocate(self, Request r, long long n, vector[int]& computed)
    cdef void _allocate(self, Request r, long long n, vector[int]& computed, cbool admission,
                        vector[int]& new_blocks) except *
    cpdef void free(self, Request request)
    cpdef void cache_full_blocks(self, Request request)
    cdef void _update_block_hashes(self, Request r)


cdef inline long long cache_written_tokens(KVCacheManager kv, Request r):
    """Prompt tokens in r's blocks registered in the prefix cache (its hits included), capped
    at the prompt: vLLM's estimate_cached_tokens; 0 without caching (no block registered)."""
    cdef long long n = <long long>r.num_cached_blocks * kv.block_size
    return n if n < r.num_prompt else r.num_prompt
