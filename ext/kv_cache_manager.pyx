# distutils: language = c++
"""Native KV block manager and request record: trillm._ext.kv_cache_manager (twins:
trillm/core/kv_cache_manager.py, trillm/core/request.py). Declared in
ext/kv_cache_manager.pxd (beside this file), which ext/scheduler.pyx cimports: compiled once,
here."""

from cython.operator cimport dereference as cython_deref

from libc.stdint cimport uint64_t, int64_t
from libcpp cimport bool as cbool
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from trillm.core.errors import BlockAllocationError
from trillm.core.kv_cache_manager import request_extra_keys
from trillm.core.request import RequestStatus


cdef object _key_to_int(Key128 k):
    return (<object>k.hi << 64) | <object>k.lo


cdef Key128 _int_to_key(object v):
    cdef Key128 k
    k.lo = <uint64_t>(v & 0xFFFFFFFFFFFFFFFF)
    k.hi = <uint64_t>((v >> 64) & 0xFFFFFFFFFFFFFFFF)
    return k


def hash_block_tokens(parent_hash, token_ids, extra):
    """Native twin of trillm.core.kv_cache_manager.hash_block_tokens."""
    cdef vector[int64_t] toks
    cdef vector[uint64_t] ex
    cdef Key128 parent
    parent.lo = 0
    parent.hi = 0
    for t in token_ids:
        toks.push_back(<int64_t>t)
    for e in extra:
        ex.push_back(<uint64_t>e)
    if parent_hash is not None:
        parent = _int_to_key(parent_hash)
    return _key_to_int(hash_block(parent_hash is not None, parent, toks.data(), <int>toks.size(),
                                  ex.data(), <int>ex.size()))


cdef class Request:
    """Native twin of trillm.core.request.Request: token ids and block table in C++ vectors."""

    def __init__(self, str request_id, prompt_token_ids, sampling_params,
                 double arrival_time=0.0, eos_token_id=None, long long priority=0,
                 cache_salt=None, extra_hash_keys=()):
        self.request_id = request_id
        self._prompt = list(prompt_token_ids)
        for t in self._prompt:
            self.tokens.push_back(<int64_t>t)
        self.num_prompt = len(self._prompt)
        self.sampling_params = sampling_params
        self.has_max_tokens = sampling_params.max_tokens is not None
        self.max_tokens_ = sampling_params.max_tokens if self.has_max_tokens else 0
        self.min_tokens = sampling_params.min_tokens
        self.ignore_eos = sampling_params.ignore_eos
        for t in (sampling_params.stop_token_ids or ()):
            self.stop_ids.push_back(<int64_t>t)
        self.has_eos = eos_token_id is not None
        self.eos = eos_token_id if self.has_eos else 0
        self.priority = priority
        self.arrival_time = arrival_time
        self.status_ = ST_WAITING
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.extra_hash_keys = list(extra_hash_keys)
        first, later = request_extra_keys(self)
        for k in first:
            self.first_keys.push_back(<uint64_t>k)
        for k in later:
            self.later_keys.push_back(<uint64_t>k)
        self.structured = sampling_params.structured_outputs is not None
        self.skip_prefix_lookup = sampling_params.prompt_logprobs is not None

    @classmethod
    def from_engine_core_request(cls, req):
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params, req.arrival_time,
                   req.eos_token_id, req.priority, req.cache_salt, req.extra_hash_keys)

    @property
    def prompt_token_ids(self):
        return list(self._prompt)

    @property
    def output_token_ids(self):
        return [self.tokens[i] for i in range(self.num_prompt, <int>self.tokens.size())]

    @property
    def all_token_ids(self):
        return [t for t in self.tokens]

    @property
    def spec_token_ids(self):
        return [t for t in self.spec]

    @spec_token_ids.setter
    def spec_token_ids(self, value):
        self.spec.clear()
        for t in value:
            self.spec.push_back(<int64_t>t)

    @property
    def max_tokens(self):
        return self.max_tokens_ if self.has_max_tokens else None

    @property
    def eos_token_id(self):
        return self.eos if self.has_eos else None

    @property
    def stop_token_ids(self):
        return [t for t in self.stop_ids]

    @property
    def status(self):
        return RequestStatus(self.status_)

    @property
    def num_cached_tokens(self):
        return self.num_cached_ if self.has_num_cached else None

    @num_cached_tokens.setter
    def num_cached_tokens(self, value):
        # a KV connector's failed load sets it back to the tokens still valid
        self.has_num_cached = value is not None
        self.num_cached_ = 0 if value is None else value

    @property
    def block_hashes(self):
        return [_key_to_int(k) for k in self.hashes]

    @property
    def num_prompt_tokens(self):
        return self.num_prompt

    @property
    def num_output_tokens(self):
        return <int>self.tokens.size() - self.num_prompt

    @property
    def num_tokens(self):
        return <int>self.tokens.size()

    @property
    def num_tokens_with_spec(self):
        return <int>(self.tokens.size() + self.spec.size())

    @property
    def is_finished(self):
        return self.status_ >= ST_FINISHED_STOPPED

    def append_output_token(self, long long token_id):
        self.tokens.push_back(token_id)

    def __repr__(self):
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


cdef class KVCacheManager:
    """Native twin of trillm.core.kv_cache_manager.KVCacheManager (same API, same block ids)."""

    def __init__(self, int num_blocks, int block_size, enable_prefix_caching=True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.ref_cnt.assign(num_blocks, 0)
        self.prev_.assign(num_blocks, -1)
        self.next_.assign(num_blocks, -1)
        self.in_free.assign(num_blocks, 0)
        self.block_hash.resize(num_blocks)
        self.has_hash.assign(num_blocks, 0)
        self.block_tokens.assign(<size_t>num_blocks * block_size, 0)
        self.head = -1
        self.tail = -1
        self.nfree = 0
        self.tables = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        cdef int b
        for b in range(num_blocks):
            _push_free(self, b)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self):
        return self.nfree

    @property
    def usage(self):
        return 1.0 - <double>self.nfree / self.num_blocks

    def get_block_ids(self, req_id):
        cdef Request r = self.tables.get(req_id)
        if r is None:
            return []
        return [b for b in r.block_ids]

    def get_ref_counts(self):
        return [c for c in self.ref_cnt]

    def free_block_ids(self):
        out = []
        cdef int b = self.head
        while b >= 0:
            out.append(b)
            b = self.next_[b]
        return out

    def num_cached_blocks_total(self):
        return self.cached.size()

    def num_cache_written_tokens(self, Request request):
        """Prompt tokens in the request's blocks registered in the prefix cache (its hits
        included), capped at the prompt; 0 without caching (see the Python twin)."""
        return cache_written_tokens(self, request)

    def block_hashes(self, Request request):
        self._update_block_hashes(request)
        return request.block_hashes

    # ------------------------------------------------------------------ prefix lookup

    cdef int _lookup(self, Request r, vector[int]& out):
        out.clear()
        if not self.enable_prefix_caching or r.skip_prefix_lookup:
            return 0
        cdef int bs = self.block_size
        cdef int max_blocks = (<int>r.tokens.size() - 1) // bs
        self._update_block_hashes(r)
        cdef int i, b, j
        cdef unordered_map[Key128, int].iterator it
        cdef cbool same
        for i in range(max_blocks):
            it = self.cached.find(r.hashes[i])
            if it == self.cached.end():
                break
            b = cython_deref(it).second
            same = True
            for j in range(bs):
                if self.block_tokens[<size_t>b * bs + j] != r.tokens[i * bs + j]:
                    same = False
                    break
            if not same:
                break
            out.push_back(b)
        return <int>out.size() * bs

    def get_computed_blocks(self, Request request):
        """Longest cached prefix of full blocks -> (block ids, num tokens they hold)."""
        cdef vector[int] blocks
        cdef int n = self._lookup(request, blocks)
        return [b for b in blocks], n

    # ------------------------------------------------------------------ allocation

    cdef cbool _can_allocate(self, Request r, long long n, vector[int]& computed):
        cdef int revived = 0
        cdef int b
        for b in computed:
            if self.ref_cnt[b] == 0:
                revived += 1
        return _num_new_blocks(self, r, n, <int>computed.size()) + revived <= self.nfree

    def can_allocate(self, Request request, long long num_new_tokens, new_computed_blocks=()):
        cdef vector[int] computed = _to_int_vector(new_computed_blocks)
        return self._can_allocate(request, num_new_tokens, computed)

    cdef void _allocate(self, Request r, long long n, vector[int]& computed, cbool admission,
                        vector[int]& new_blocks) except *:
        if not self._can_allocate(r, n, computed):
            raise BlockAllocationError(
                f"Request {r.request_id!r} needs more blocks than the {self.nfree} free ones "
                f"for {n} new tokens; call can_allocate first.")
        if admission and self.enable_prefix_caching:
            self.prefix_cache_queries += <long long>r.tokens.size()
            self.prefix_cache_hits += <long long>computed.size() * self.block_size
        cdef int num_new = _num_new_blocks(self, r, n, <int>computed.size())
        if not r.has_table:
            r.has_table = True
            r.block_ids.clear()
            r.num_cached_blocks = 0
            self.tables[r.request_id] = r
        cdef int b
        for b in computed:
            if self.ref_cnt[b] == 0:
                _remove_free(self, b)
            self.ref_cnt[b] += 1
            r.block_ids.push_back(b)
        if computed.size() > 0:
            r.num_cached_blocks = <int>r.block_ids.size()
        new_blocks.clear()
        cdef int i
        for i in range(num_new):
            b = self.head
            _remove_free(self, b)
            _evict(self, b)
            self.ref_cnt[b] = 1
            r.block_ids.push_back(b)
            new_blocks.push_back(b)

    def allocate_slots(self, Request request, long long num_new_tokens,
                       new_computed_blocks=None):
        """Give ``request`` room for ``num_new_tokens`` more tokens -> the new block ids."""
        cdef vector[int] computed = _to_int_vector(new_computed_blocks or ())
        cdef vector[int] new_blocks
        self._allocate(request, num_new_tokens, computed, new_computed_blocks is not None,
                       new_blocks)
        return [b for b in new_blocks]

    # ------------------------------------------------------------------ free / cache

    cpdef void free(self, Request request):
        """Drop the request's references; tail blocks enter the LRU queue first."""
        if not request.has_table:
            return
        cdef int i, b
        for i in range(<int>request.block_ids.size() - 1, -1, -1):
            b = request.block_ids[i]
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                _push_free(self, b)
        request.block_ids.clear()
        request.num_cached_blocks = 0
        request.has_table = False
        del self.tables[request.request_id]

    cpdef void cache_full_blocks(self, Request request):
        """Register the request's full blocks whose KV is computed (< num_computed_tokens)."""
        if not self.enable_prefix_caching or not request.has_table:
            return
        cdef int bs = self.block_size
        cdef long long ntok = <long long>request.tokens.size()
        cdef long long done = request.num_computed_tokens if request.num_computed_tokens < ntok else ntok
        cdef int num_full = <int>(done // bs)
        if num_full > <int>request.block_ids.size():
            num_full = <int>request.block_ids.size()
        cdef int start = request.num_cached_blocks
        if num_full <= start:
            return
        self._update_block_hashes(request)
        cdef int i, b, j
        cdef Key128 h
        for i in range(start, num_full):
            b = request.block_ids[i]
            h = request.hashes[i]
            if self.has_hash[b] or self.cached.count(h):
                continue
            self.cached[h] = b
            self.block_hash[b] = h
            self.has_hash[b] = 1
            for j in range(bs):
                self.block_tokens[<size_t>b * bs + j] = request.tokens[i * bs + j]
        request.num_cached_blocks = num_full

    cdef void _update_block_hashes(self, Request r):
        cdef int bs = self.block_size
        cdef int num_full = <int>r.tokens.size() // bs
        cdef int i
        cdef Key128 parent
        cdef vector[uint64_t]* keys
        parent.lo = 0
        parent.hi = 0
        for i in range(<int>r.hashes.size(), num_full):
            if i > 0:
                parent = r.hashes[i - 1]
                keys = &r.later_keys
            else:
                keys = &r.first_keys
            r.hashes.push_back(hash_block(i > 0, parent, r.tokens.data() + <size_t>i * bs, bs,
                                          keys.data(), <int>keys.size()))

    def reset_prefix_cache(self):
        """Forget every cached hash; blocks in use keep their KV but are no longer shareable."""
        self.cached.clear()
        cdef int b
        for b in range(self.num_blocks):
            self.has_hash[b] = 0


cdef vector[int] _to_int_vector(object values):
    cdef vector[int] out
    for v in values:
        out.push_back(<int>v)
    return out


# The free queue and block eviction, inlined into the methods above.


cdef inline void _push_free(KVCacheManager self, int b):
    self.prev_[b] = self.tail
    self.next_[b] = -1
    if self.tail >= 0:
        self.next_[self.tail] = b
    else:
        self.head = b
    self.tail = b
    self.in_free[b] = 1
    self.nfree += 1


cdef inline void _remove_free(KVCacheManager self, int b):
    cdef int p = self.prev_[b]
    cdef int n = self.next_[b]
    if p >= 0:
        self.next_[p] = n
    else:
        self.head = n
    if n >= 0:
        self.prev_[n] = p
    else:
        self.tail = p
    self.in_free[b] = 0
    self.nfree -= 1


cdef inline int _num_new_blocks(KVCacheManager self, Request r, long long num_new_tokens,
                                int num_computed_blocks):
    cdef long long held = <long long>r.block_ids.size() + num_computed_blocks
    cdef long long total = r.num_computed_tokens + <long long>num_computed_blocks * self.block_size
    cdef long long needed = (total + num_new_tokens + self.block_size - 1) // self.block_size
    return <int>(needed - held) if needed > held else 0


cdef inline void _evict(KVCacheManager self, int b):
    cdef unordered_map[Key128, int].iterator it
    if self.has_hash[b]:
        it = self.cached.find(self.block_hash[b])
        if it != self.cached.end() and cython_deref(it).second == b:
            self.cached.erase(it)
        self.has_hash[b] = 0
