// Stage 7 (model forward) on CPU: paged attention that reads K/V in place from the block-paged
// cache.
//
// The contract is the one of trillm/attention/backend.py and its torch reference
// (kernels/paged_attention_torch.py): request r owns query rows
// query_start_loc[r] .. query_start_loc[r+1], at positions seq_lens[r] - query_len .. seq_lens[r]-1,
// and attends causally to the cached keys/values of positions 0 .. its own (this step's rows
// already written). GQA: query head h reads kv head h / (Hq / Hkv).
//
// Work item = (request, tile of query rows, range of kv heads: all of them unless that leaves
// too few items for the threads): the tile's query vectors walk the request's blocks once, a
// chunk of keys at a time, each key row brought in once for all the query heads that read it,
// with an online softmax in fp32. No gather, no padding, no mask tensor. Items run on a small
// persistent thread pool (the caller's thread included); the GIL is released meanwhile. Fewer
// one-row items than twice the threads (batch-1 decode): fp32 q runs each item as parts of its
// keys, merged in a fixed order (ext/cpu_attention_key_splits.h). fp32
// and bf16 tensors; the cache fp32, bf16 or fp8 e4m3 (--kv-cache-dtype), widened exactly to
// fp32 as it is read; math in fp32. bf16 q computes what transformers' bf16 eager attention
// computes instead: scores rounded to bf16 (kBf16Scores), then two passes, not an online
// softmax (rounded_softmax_pv; the rounding points shared with the fresh-prompt kernel in
// ext/cpu_attention_bf16.h).
//
// Files: this one holds the problem, the bf16 glue, the dispatch, the plan and the bindings;
// the two kernels are included from ext/cpu_attention_tile.h (several query rows per item) and
// ext/cpu_attention_decode.h (one row: decode steps), whose bf16 rows over a bf16 cache run on
// ext/cpu_attention_decode_dp_slots.h (vdpbf16ps, each cache slot read once for the item's kv
// heads; ext/cpu_attention_decode_dp.h its per-head twin) instead on CPUs with AVX512-BF16;
// bf16 chunks of 16 rows or more (a long prompt's later chunks) run on
// ext/cpu_attention_paged_dp.h instead on CPUs with AVX512-BF16, on ext/cpu_attention_paged_avx2.h
// on those with AVX2 + FMA only. Which of them a CPU runs (and the override of tests):
// ext/cpu_attention_kernel_choice.h.
//
// Per layer, optionally: a sliding window (window > 0: a row at position p sees positions
// > p - window; its keys before that are neither read nor scored), logit soft-capping
// (softcap > 0: scores -> softcap * tanh(scores / softcap), Gemma 2) and, fp32 only,
// attention sinks (a learned logit per query head in the softmax's denominator, gpt-oss).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_attention_bf16.h"
#include "cpu_common.h"
#include "cpu_program.h"
#if defined(__x86_64__) && defined(__GNUC__)
#include "cpu_attention_avx2_tiles.h"  // the fresh-prompt kernel's tiles: long chunks, AVX2
#include "cpu_attention_dp_tiles.h"    // and on AVX512-BF16's vdpbf16ps
#endif

namespace py = pybind11;

namespace {

constexpr int kMaxTileRows = 16;   // query rows per work item
constexpr int kMaxVectors = 64;    // query vectors per work item (rows x heads per kv head)
constexpr int kMaxLanes = 4096;    // query vectors x head_dim / 8 per work item
constexpr int kKeyChunk = 32;      // keys scored at once (4 x 8 lanes)
constexpr int kMaxHeadDim = 512;

struct Problem {
  const void* q;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_table;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t q_token_stride;  // elements between q rows (q may be a view of a fused qkv)
  int64_t q_head_stride;
  int64_t out_token_stride;
  int64_t out_head_stride;
  int64_t block_table_stride;
  int max_blocks_per_req, num_blocks;
  int num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int window;     // 0: none
  float softcap;  // 0: none
  const float* sinks;  // [num_heads] fp32 attention sinks (gpt-oss); nullptr: none
  float* partials;     // the split items' partials (Item::partial); nullptr: no split items
};

// An attention sink: one more logit in a query head's softmax, attending to no value. Folded
// into a finished online softmax (running max m, sum l, unnormalised acc): with
// m' = max(m, sink) and c = exp(m - m'), acc *= c and l = l * c + exp(sink - m').
TRILLM_INLINE void add_sink(float sink, float& m, float& l, v8f* arow, int NV) {
  const float top = std::max(m, sink);
  const float c = std::exp(m - top);
  l = l * c + std::exp(sink - top);
  const v8f cv = splat(c);
  for (int j = 0; j < NV; ++j) arow[j] = arow[j] * cv;
  m = top;
}

// softcap * tanh(s / softcap) on the first n scores (already scaled).
TRILLM_INLINE void soft_cap(float* s, int n, float softcap) {
  for (int u = 0; u < n; ++u) s[u] = softcap * std::tanh(s[u] / softcap);
}

// bf16 q (a bf16 model): the scores take transformers' bf16 rounding points, q . k rounded to
// bf16 (a bf16 matmul with fp32 sums), then times the scale, rounded again; the softmax is
// fp32 and its probabilities are rounded to bf16 (rounded_softmax_pv). The roundings move a
// score by up to half a bf16 step (0.4%), enough to flip near-tied greedy tokens against a bf16
// reference; fp32 q keeps the scale folded into q, unrounded, and the online softmax.
template <typename T>
constexpr bool kBf16Scores = std::is_same<T, Bf16>::value;

template <typename T>
TRILLM_INLINE float q_scale(const Problem& p) {
  return kBf16Scores<T> ? 1.0f : p.scale;
}

template <typename T>
TRILLM_INLINE v8f finish_scores(v8f sums, const Problem& p) {
  if (!kBf16Scores<T>) return sums;  // already scaled through q
  return round_scores(sums, splat(p.scale));
}

// Query vector v's rows of qv and acc ([NV] each): its D values of q times q_scale<T>, zeros.
template <typename T>
TRILLM_INLINE void start_vector(const Problem& p, const T* src, int NV, v8f* qrow, v8f* arow) {
  for (int j = 0; j < NV; ++j) {
    qrow[j] = load8(src + 8 * j) * splat(q_scale<T>(p));
    arow[j] = splat(0.0f);
  }
}

// A vector's output: its acc row divided by l (>= 1), rounded to T at the store.
template <typename T>
TRILLM_INLINE void store_output(T* dst, const v8f* arow, int NV, float l) {
  const v8f inv = splat(1.0f / l);
  for (int j = 0; j < NV; ++j) {
    const v8f x = arow[j] * inv;
    for (int d = 0; d < 8; ++d) store(dst + 8 * j + d, x[d]);
  }
}

struct Item {
  int req, row_begin, row_end;  // rows relative to the request's first query row
  int head_begin, head_end;     // kv heads
  // A one-row item split by key range (flash-decoding; plan_key_splits): this item is
  // part `split` of `splits` of the row's keys and writes its unnormalised partial (per vector:
  // max m, sum l, acc[head_dim]) at p.partials + partial instead of the output.
  int split = 0, splits = 1;
  int64_t partial = 0;
};

// bf16 q, once every score of an item is known: transformers' eager attention from there on
// (ext/cpu_attention_bf16.h), the soft cap, then per vector the softmax with its probabilities
// rounded to bf16 (rounded_softmax_row), then acc = sum_t p_t v_t in fp32.
// s: [nvec][stride] scores of keys key_begin + i; vector v sees keys lo[v] .. hi[v] (absolute
// positions, inclusive) and reads their values at value_rows(start, n, rows)[u] + off[v].
// acc [nvec][NV] is overwritten with the output (no division left).
template <typename C, int NV_FIXED, typename Rows>
TRILLM_INLINE void rounded_softmax_pv(const Problem& p, int nvec, float* s, int stride,
                                      int key_begin, int key_end, const int* lo, const int* hi,
                                      const int64_t* off, v8f* acc, Rows value_rows) {
  const int NV = NV_FIXED > 0 ? NV_FIXED : p.head_dim / 8;
  for (int v = 0; v < nvec; ++v) {
    float* row = s + static_cast<int64_t>(v) * stride + (lo[v] - key_begin);
    const int n = hi[v] - lo[v] + 1;  // >= 1: a row always sees its own key
    if (p.softcap > 0.0f) soft_cap(row, n, p.softcap);
    rounded_softmax_row(row, n);
    for (int j = 0; j < NV; ++j) acc[v * NV + j] = splat(0.0f);
  }
  // P @ V a chunk of keys at a time: the chunk's value rows serve every vector that reads them.
  const C* vr[kKeyChunk];
  for (int start = key_begin; start < key_end; start += kKeyChunk) {
    const int n = std::min(kKeyChunk, key_end - start);
    value_rows(start, n, vr);
    for (int v = 0; v < nvec; ++v) {
      const int u0 = std::max(0, lo[v] - start), u1 = std::min(n, hi[v] - start + 1);
      if (u0 >= u1) continue;
      const float* w = s + static_cast<int64_t>(v) * stride + (start - key_begin);
      v8f r[NV_FIXED > 0 ? NV_FIXED : kMaxHeadDim / 8];
      v8f* a = acc + v * NV;
      for (int j = 0; j < NV; ++j) r[j] = a[j];
      for (int u = u0; u < u1; ++u) {
        const v8f wu = splat(w[u]);
        const C* val = vr[u] + off[v];
        for (int j = 0; j < NV; ++j) r[j] += wu * load8(val + 8 * j);
      }
      for (int j = 0; j < NV; ++j) a[j] = r[j];
    }
  }
}

// The kernels, included here inside this anonymous namespace: both walk a request's keys a
// chunk at a time with an online softmax (fp32 q) or keep every score for the rounded softmax
// (bf16 q, rounded_softmax_pv above).
#include "cpu_attention_tile.h"    // attend_item: tiles of several query rows
#include "cpu_attention_decode.h"  // attend_decode: one-row tiles (decode steps), head_dim 64 / 128
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "cpu_attention_paged_dp.h"    // attend_item_paged_dp: long chunks, bf16, AVX512-BF16
#include "cpu_attention_paged_avx2.h"  // attend_item_paged_avx2: the same, AVX2 + FMA
#include "cpu_attention_decode_dp.h"   // attend_decode_dp: bf16 decode rows, AVX512-BF16
#include "cpu_attention_decode_dp_slots.h"  // attend_decode_ds: the same, slots read once
#define TRILLM_PAGED_DP 1
#else
#define TRILLM_PAGED_DP 0
#endif

#include "cpu_attention_kernel_choice.h"  // cpu_has_paged_dp, chunk_kernel, decode_kernel

// KB / JB: the tile kernel's blocks of accumulators (keys x group, value lanes x group), sized
// to AVX2's 16 vector registers. (An AVX-512VL build of the same 8-lane code with 32 registers
// and blocks of 4 x 4 gave the same bits but ran slower: 14.4 against 14.1 ms on
// benchmarks/kernels/attention_tile.py's 256-token chunk over 1024 keys.)
template <typename T, typename C, int KB, int JB>
TRILLM_INLINE void attend_dispatch(const Problem& p, const Item& it) {
  const bool one_row = it.row_end - it.row_begin == 1;
  switch (p.head_dim) {
    case 64:
      return one_row ? attend_decode<T, C, 8>(p, it) : attend_item<T, C, 8, KB, JB>(p, it);
    case 128:
      return one_row ? attend_decode<T, C, 16>(p, it) : attend_item<T, C, 16, KB, JB>(p, it);
    default:
      return attend_item<T, C, 0, KB, JB>(p, it);
  }
}

// On x86-64 the generic kernel only serves CPUs without AVX2; built at -O1 there, as GCC's -O3 on
// its fully inlined tiles took half of this file's ~150 s compile (one core), the longest step of
// a fresh install. Elsewhere (e.g. aarch64) it is the only kernel and keeps -O3.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TRILLM_FALLBACK_OPT __attribute__((optimize("O1")))
#else
#define TRILLM_FALLBACK_OPT
#endif

template <typename T, typename C>
TRILLM_FALLBACK_OPT void attend_generic(const Problem& p, const Item& it) {
  attend_dispatch<T, C, 2, 2>(p, it);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename T, typename C>
__attribute__((target("avx2,fma"))) void attend_avx2(const Problem& p, const Item& it) {
  attend_dispatch<T, C, 2, 2>(p, it);
}
#endif

using Kernel = void (*)(const Problem&, const Item&);

#if TRILLM_PAGED_DP
// bf16 q over a bf16 cache: one-row items on attend_decode_dp, the others on the AVX2 kernel.
void attend_bf16_decode_dp(const Problem& p, const Item& it) {
  if (it.row_end - it.row_begin == 1) attend_decode_dp(p, it);
  else attend_avx2<Bf16, Bf16>(p, it);
}
void attend_bf16_decode_ds(const Problem& p, const Item& it) {
  if (it.row_end - it.row_begin == 1) attend_decode_ds(p, it);
  else attend_avx2<Bf16, Bf16>(p, it);
}

// head_dim 64 / 128, a bf16 or fp8 cache: one-row items on the one-row kernel that widens each
// key / value row once for a block of its GQA group (the "avx2" decode kernel), the others on
// the AVX2 kernel. (An fp32 cache has nothing to widen: there the shared loops' extra loads of q
// made it slower, at Llama-3.2-1B's shape 190 against 176 ms a step at batch 16 x 1,024 keys.)
template <typename T, typename C>
__attribute__((target("avx2,fma"))) void attend_decode_avx2(const Problem& p, const Item& it) {
  if (it.row_end - it.row_begin != 1) return attend_avx2<T, C>(p, it);
  if (p.head_dim == 64) attend_decode<T, C, 8, true>(p, it);
  else attend_decode<T, C, 16, true>(p, it);
}

template <typename T>
Kernel decode_avx2_for_cache(int cache_dtype) {
  return cache_dtype == 1 ? &attend_decode_avx2<T, Bf16> : &attend_decode_avx2<T, Fp8>;
}
#endif

#include "cpu_attention_key_splits.h"  // plan_key_splits, merge_key_splits: batch-1 parts

// set_kernel("generic") runs the fallback on a CPU that has AVX2 too (tests: it is otherwise
// never run where the suite runs).
std::atomic<bool>& force_generic() {
  static std::atomic<bool> force{false};
  return force;
}

template <typename T, typename C>
Kernel select_kernel() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx2 = cpu_has_avx2();
  if (avx2 && !force_generic().load(std::memory_order_relaxed)) return &attend_avx2<T, C>;
#endif
  return &attend_generic<T, C>;
}

bool has_avx2_kernel() {
#if defined(__x86_64__) && defined(__GNUC__)
  return cpu_has_avx2();
#else
  return false;
#endif
}

std::string get_kernel() {
  return has_avx2_kernel() && !force_generic().load() ? "avx2" : "generic";
}

void set_kernel(const std::string& name) {
  if (name == "generic") {
    force_generic() = true;
  } else if (name == "avx2") {
    if (!has_avx2_kernel()) throw std::runtime_error("this CPU (or build) has no AVX2 kernel");
    force_generic() = false;
  } else {
    throw std::invalid_argument("kernel must be 'avx2' or 'generic'");
  }
}

// dtype (q and out): 0 float32, 1 bfloat16; cache_dtype: the same codes, 2 = fp8 e4m3.
template <typename T>
Kernel select_for_cache(int cache_dtype) {
  switch (cache_dtype) {
    case 0: return select_kernel<T, float>();
    case 1: return select_kernel<T, Bf16>();
    default: return select_kernel<T, Fp8>();
  }
}

// Work items of the requests `reqs` (all num_reqs when reqs is null). An item takes every kv
// head of a tile of query rows (each key row is then read whole, sequentially) unless that
// leaves too few items for the threads or too many vectors; then one kv head each.
std::vector<Item> plan_items(const Problem& p, int num_reqs, const int32_t* reqs,
                             int num_selected, int num_threads) {
  const int group = p.num_heads / p.num_kv_heads;
  const int lanes = p.head_dim / 8;
  const int count = reqs == nullptr ? num_reqs : num_selected;
  const bool whole = p.num_heads <= kMaxVectors && p.num_heads * lanes <= kMaxLanes &&
                     count >= 4 * num_threads;
  const int heads = whole ? p.num_kv_heads : 1;
  const int per_row = heads * group;
  const int tile_rows =
      std::max(1, std::min({kMaxTileRows, kMaxVectors / per_row, kMaxLanes / (per_row * lanes)}));
  std::vector<Item> items;
  for (int i = 0; i < count; ++i) {
    const int r = reqs == nullptr ? i : reqs[i];
    if (r < 0 || r >= num_reqs) throw std::invalid_argument("request index out of range");
    const int query_len = p.query_start_loc[r + 1] - p.query_start_loc[r];
    const int seq_len = p.seq_lens[r];
    if (query_len < 0 || query_len > seq_len) throw std::invalid_argument("query_len > seq_len");
    const int used_blocks = (seq_len + p.block_size - 1) / p.block_size;
    if (used_blocks > p.max_blocks_per_req)
      throw std::invalid_argument("seq_len exceeds the block table's row");
    const int32_t* row = p.block_table + static_cast<int64_t>(r) * p.block_table_stride;
    for (int b = 0; b < used_blocks; ++b) {
      if (row[b] < 0 || row[b] >= p.num_blocks)
        throw std::invalid_argument("block id out of the cache's range");
    }
    for (int begin = 0; begin < query_len; begin += tile_rows) {
      const int end = std::min(query_len, begin + tile_rows);
      for (int h = 0; h < p.num_kv_heads; h += heads) items.push_back({r, begin, end, h, h + heads});
    }
  }
  return items;
}

// One step's attention plan: the metadata checked and the work items made once, then run by
// every layer (each with its own q, cache and output). The metadata arrays must outlive the
// plan (the Python wrapper keeps them).
class Plan {
 public:
  // req_indices: 0 (every request) or num_selected int32 request indices (only their rows of
  // the output are written).
  Plan(uintptr_t block_table, uintptr_t query_start_loc, uintptr_t seq_lens, int num_reqs,
       uintptr_t req_indices, int num_selected, int num_heads, int num_kv_heads, int head_dim,
       int block_size, int num_blocks, int64_t block_table_stride, int max_blocks_per_req,
       int num_threads)
      : num_threads_(num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0)
      throw std::invalid_argument("num_heads must be a multiple of num_kv_heads");
    if (num_heads / num_kv_heads > kMaxVectors)
      throw std::invalid_argument("more than 64 query heads per kv head");
    if (head_dim <= 0 || head_dim > kMaxHeadDim || head_dim % 8 != 0)
      throw std::invalid_argument("head_dim must be a multiple of 8 in 8..512");
    if (block_size <= 0) throw std::invalid_argument("block_size must be positive");
    p_.block_table = reinterpret_cast<const int32_t*>(block_table);
    p_.query_start_loc = reinterpret_cast<const int32_t*>(query_start_loc);
    p_.seq_lens = reinterpret_cast<const int32_t*>(seq_lens);
    p_.block_table_stride = block_table_stride;
    p_.max_blocks_per_req = max_blocks_per_req;
    p_.num_blocks = num_blocks;
    p_.num_heads = num_heads;
    p_.num_kv_heads = num_kv_heads;
    p_.head_dim = head_dim;
    p_.block_size = block_size;
    items_ = plan_items(p_, num_reqs, reinterpret_cast<const int32_t*>(req_indices), num_selected,
                        num_threads);
    plan_chunk_items();
    if (key_splits().load(std::memory_order_relaxed))
      partial_floats_ = plan_key_splits(p_, items_, num_threads_, split_items_);
  }

  // The items of the run on attend_item_paged_dp or _avx2 (bf16, no window or softcap): a
  // request of at least kPdpMinQueryRows query rows as (kv head, block of 96 / group rows)
  // items, ordered by PdpShared::plan; the other requests' items as they are. Empty where
  // neither runs.
  void plan_chunk_items() {
#if TRILLM_PAGED_DP
    if (!cpu_has_avx2() || !paged_dp_layout(p_.num_heads, p_.num_kv_heads, p_.head_dim)) return;
    const int block = std::max(1, kPdpMaxVectors / (p_.num_heads / p_.num_kv_heads));
    std::vector<Item> long_items, rest;
    for (const Item& it : items_) {
      const int query_len = p_.query_start_loc[it.req + 1] - p_.query_start_loc[it.req];
      if (query_len < kPdpMinQueryRows) {
        rest.push_back(it);
      } else if (it.row_begin == 0 && it.head_begin == 0) {  // once per request
        for (int first = 0; first < query_len; first += block)
          for (int h = 0; h < p_.num_kv_heads; ++h)
            long_items.push_back({it.req, first, std::min(query_len, first + block), h, h + 1});
      }
    }
    if (long_items.empty()) return;
    // (the most work first; in batches of units whose packed tiles fit the scratch)
    pdp_.plan(p_, long_items, chunk_pack_bytes().load(std::memory_order_relaxed));
    chunk_long_ = static_cast<int>(long_items.size());
    chunk_items_ = std::move(long_items);
    chunk_items_.insert(chunk_items_.end(), rest.begin(), rest.end());
#endif
  }

  // dtype (q, out): 0 = float32, 1 = bfloat16; cache_dtype: 0, 1, or 2 = fp8 e4m3 (values
  // stored as x / scale with the scale 1.0: read as they are).
  void run(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache,
           int64_t q_token_stride, int64_t q_head_stride, int64_t out_token_stride,
           int64_t out_head_stride, float scale, int dtype, int window, float softcap,
           int cache_dtype, uintptr_t sinks) const {
    if (dtype != 0 && dtype != 1) throw std::invalid_argument("dtype must be float32 or bfloat16");
    if (window < 0 || !(softcap >= 0.0f))
      throw std::invalid_argument("window and softcap must be >= 0 (0: none)");
    if (cache_dtype < 0 || cache_dtype > 2)
      throw std::invalid_argument("cache_dtype must be float32, bfloat16 or fp8");
    if (sinks != 0 && dtype != 0)
      throw std::invalid_argument("attention sinks are implemented for float32 only");
    Problem p = p_;
    p.q = reinterpret_cast<const void*>(q);
    p.out = reinterpret_cast<void*>(out);
    p.k_cache = reinterpret_cast<const void*>(k_cache);
    p.v_cache = reinterpret_cast<const void*>(v_cache);
    p.q_token_stride = q_token_stride;
    p.q_head_stride = q_head_stride;
    p.out_token_stride = out_token_stride;
    p.out_head_stride = out_head_stride;
    p.scale = scale;
    p.window = window;
    p.softcap = softcap;
    p.sinks = reinterpret_cast<const float*>(sinks);
    Kernel kernel =
        dtype == 0 ? select_for_cache<float>(cache_dtype) : select_for_cache<Bf16>(cache_dtype);
#if TRILLM_PAGED_DP
    // Decode rows: vdpbf16ps for bf16 over bf16, the group-sharing one-row kernel for the other
    // bf16 / fp8 caches (and for all of them where it is the setting); fp32 caches keep the
    // one-row kernel; set_kernel("generic") keeps both off.
    const int decode = decode_kernel().load(std::memory_order_relaxed);
    if (decode != kDecodeRow && cache_dtype != 0 && decode_dp_layout(p.head_dim) &&
        !force_generic().load(std::memory_order_relaxed)) {
      if ((decode == kDecodeBf16Dot || decode == kDecodeBf16DotPerHead) && dtype == 1 &&
          cache_dtype == 1)
        kernel = decode == kDecodeBf16Dot ? &attend_bf16_decode_ds : &attend_bf16_decode_dp;
      else
        kernel = dtype == 0 ? decode_avx2_for_cache<float>(cache_dtype)
                            : decode_avx2_for_cache<Bf16>(cache_dtype);
    }
#endif
#if TRILLM_PAGED_DP
    const int chunks = chunk_kernel().load(std::memory_order_relaxed);
    // (set_kernel("generic") stands for a CPU without AVX2: neither long-chunk kernel runs)
    if (chunk_long_ > 0 && dtype == 1 && cache_dtype == 1 && window == 0 && softcap == 0.0f &&
        chunks != kChunkTile && !force_generic().load(std::memory_order_relaxed)) {
      const Kernel long_kernel =
          chunks == kChunkAvx2 ? &attend_item_paged_avx2 : +[](const Problem& q, const Item& it) {
            attend_item_paged_dp(q, it);  // (per item: "bf16-dot-per-item")
          };
      const int n = static_cast<int>(chunk_items_.size());
      const int n_long = chunk_long_;
      chunk_items_run[std::min(chunks, 2)].fetch_add(n_long, std::memory_order_relaxed);
      py::gil_scoped_release release;
      if (chunks == kChunkBf16Dot)  // each kv head's tiles packed once (PdpShared)
        return pdp_.run(p, num_threads_, chunk_items_, [&](int i) { kernel(p, chunk_items_[i]); });
      run_items(num_threads_, n, [&](int i) {
        if (i < n_long) long_kernel(p, chunk_items_[i]);
        else kernel(p, chunk_items_[i]);
      });
      return;
    }
#endif
    if (!split_items_.empty() && dtype == 0) {  // fp32 q: the parts, then their merge
      static thread_local std::vector<float> partials;
      if (partials.size() < static_cast<size_t>(partial_floats_)) partials.resize(partial_floats_);
      p.partials = partials.data();
      const int n = static_cast<int>(split_items_.size());
      split_items_run.fetch_add(n, std::memory_order_relaxed);
      py::gil_scoped_release release;
      run_items(num_threads_, n, [&](int i) { kernel(p, split_items_[i]); });
      merge_key_splits(p, split_items_);
      return;
    }
    const int n = static_cast<int>(items_.size());
    py::gil_scoped_release release;
    run_items(num_threads_, n, [&](int i) { kernel(p, items_[i]); });
  }

 private:
  Problem p_{};
  std::vector<Item> items_;
  std::vector<Item> chunk_items_;  // plan_chunk_items
  std::vector<Item> split_items_;  // plan_key_splits: items_ as parts of their keys (fp32 q)
  int64_t partial_floats_ = 0;     // the floats of their partials
  int chunk_long_ = 0;  // its first chunk_long_ items run on attend_item_paged_dp or _avx2
#if TRILLM_PAGED_DP
  PdpShared pdp_;  // "bf16-dot": the batches of those items and their tiles' packing
#endif
  int num_threads_;
};

// The plans of one replayed step, by slot: a step program's attention calls are bound to a slot
// (``bind_run``), and each replay sets the slots to its step's plans before the program runs.
class PlanSlots {
 public:
  explicit PlanSlots(int n) : keep_(n), plans_(n, nullptr) {
    if (n < 0) throw std::invalid_argument("a negative slot count");
  }
  void set(int i, const py::object& plan) {
    check(i);
    if (!py::isinstance<Plan>(plan)) throw py::type_error("a PlanSlots slot takes a Plan");
    plans_[i] = plan.cast<const Plan*>();
    keep_[i] = plan;
  }
  void clear() {
    for (size_t i = 0; i < plans_.size(); ++i) keep_[i] = py::object(), plans_[i] = nullptr;
  }
  int size() const { return static_cast<int>(plans_.size()); }
  const Plan& get(int i) const {
    check(i);
    if (plans_[i] == nullptr) throw std::runtime_error("attention plan slot not set");
    return *plans_[i];
  }

 private:
  void check(int i) const {
    if (i < 0 || i >= static_cast<int>(plans_.size()))
      throw std::out_of_range("attention plan slot out of range");
  }
  std::vector<py::object> keep_;
  std::vector<const Plan*> plans_;
};

}  // namespace

void register_cpu_attention(py::module_& m) {
  m.doc() = "Paged attention on CPU, reading K/V in place from the block-paged cache.";
  m.def("get_kernel", &get_kernel, "The paged kernel in use: 'avx2' or 'generic'.");
  m.def("set_kernel", &set_kernel, py::arg("name"),
        "Run the 'avx2' or the 'generic' (fallback) paged kernel, process-wide.");
  m.def("paged_chunk_kernel", &paged_chunk_kernel, py::arg("name") = "",
        "The kernel of long bf16 prompt chunks with context: 'bf16-dot' (AVX512-BF16), 'avx2' "
        "or 'tile' (the best the CPU has by default); name '' leaves it. -> the kernel before. "
        "For tests and benchmarks.");
  m.def(
      "paged_chunk_items_run",
      [](const std::string& name) {
        for (int k = kChunkAvx2; k <= kChunkBf16Dot; ++k)
          if (name == kChunkKernelNames[k]) return chunk_items_run[k].load();
        throw std::invalid_argument("the chunk kernels that count items: 'bf16-dot', 'avx2'");
      },
      py::arg("name"), "Work items the named chunk kernel has run in this process (tests).");
  m.def(
      "paged_chunk_pack_bytes",
      [](int64_t n) { return n < 0 ? chunk_pack_bytes().load() : chunk_pack_bytes().exchange(n); },
      py::arg("n") = -1,
      "The most bytes of tiles 'bf16-dot' packs at once, for plans made after; n < 0 leaves it. "
      "-> the setting before. For tests.");
  m.def(
      "paged_decode_key_splits",
      [](int on) { return on < 0 ? key_splits().load() : key_splits().exchange(on != 0); },
      py::arg("on") = -1,
      "Whether plans made after split small fp32 decode batches' rows by key range over the "
      "threads (on by default); on < 0 leaves it. -> the setting before. For tests and "
      "benchmarks.");
  m.def(
      "paged_decode_split_items_run", []() { return split_items_run.load(); },
      "Decode items run as parts of their keys in this process (tests).");
  m.def("paged_decode_kernel", &paged_decode_kernel, py::arg("name") = "",
        "The kernel of decode rows (head_dim 64 / 128): 'bf16-dot' (AVX512-BF16, bf16 over a bf16 "
        "cache; fp8 caches on 'avx2'; 'bf16-dot-per-head': the same bits, the keys walked once "
        "per kv head, as before), 'avx2' (AVX2 + FMA, bf16 / fp8 caches: each key / value "
        "row widened once for a block of the GQA group; fp32 caches on 'one-row') or 'one-row' "
        "(the best the CPU has by default); name '' leaves it. -> the kernel before. For tests "
        "and benchmarks.");
  py::class_<Plan>(m, "Plan")
      .def(py::init<uintptr_t, uintptr_t, uintptr_t, int, uintptr_t, int, int, int, int, int, int,
                    int64_t, int, int>(),
           py::arg("block_table"), py::arg("query_start_loc"), py::arg("seq_lens"),
           py::arg("num_reqs"), py::arg("req_indices"), py::arg("num_selected"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("block_size"), py::arg("num_blocks"), py::arg("block_table_stride"),
           py::arg("max_blocks_per_req"), py::arg("num_threads"))
      .def("run", &Plan::run, py::arg("out"), py::arg("q"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("q_token_stride"), py::arg("q_head_stride"),
           py::arg("out_token_stride"), py::arg("out_head_stride"), py::arg("scale"),
           py::arg("dtype"), py::arg("window") = 0, py::arg("softcap") = 0.0f,
           py::arg("cache_dtype") = 0, py::arg("sinks") = 0);
  py::class_<PlanSlots, std::shared_ptr<PlanSlots>>(m, "PlanSlots")
      .def(py::init<int>(), py::arg("n"))
      .def("set", &PlanSlots::set, py::arg("i"), py::arg("plan"))
      .def("clear", &PlanSlots::clear)
      .def(
          "bind_run",
          [](std::shared_ptr<PlanSlots> self, int i, uintptr_t out, uintptr_t q, uintptr_t k_cache,
             uintptr_t v_cache, int64_t q_token_stride, int64_t q_head_stride,
             int64_t out_token_stride, int64_t out_head_stride, float scale, int dtype, int window,
             float softcap, int cache_dtype, uintptr_t sinks) {
            if (i < 0 || i >= self->size())
              throw std::out_of_range("attention plan slot out of range");
            return trillm_cpu::Thunk{[=]() {
              self->get(i).run(out, q, k_cache, v_cache, q_token_stride, q_head_stride,
                               out_token_stride, out_head_stride, scale, dtype, window, softcap,
                               cache_dtype, sinks);
            }};
          },
          py::arg("i"), py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("q_token_stride"), py::arg("q_head_stride"), py::arg("out_token_stride"),
          py::arg("out_head_stride"), py::arg("scale"), py::arg("dtype"), py::arg("window") = 0,
          py::arg("softcap") = 0.0f, py::arg("cache_dtype") = 0, py::arg("sinks") = 0,
          "Plan(i).run(...) with these arguments, bound: a step of a Program.");
}
