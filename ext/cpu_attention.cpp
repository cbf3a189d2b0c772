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
// persistent thread pool (the caller's thread included); the GIL is released meanwhile. fp32
// and bf16 tensors; the cache fp32, bf16 or fp8 e4m3 (--kv-cache-dtype), widened exactly to
// fp32 as it is read; math in fp32. bf16 q computes what transformers' bf16 eager attention
// computes instead: scores rounded to bf16 (kBf16Scores), then two passes, not an online
// softmax (rounded_softmax_pv).
//
// Per layer, optionally: a sliding window (window > 0: a row at position p sees positions
// > p - window; its keys before that are neither read nor scored) and logit soft-capping
// (softcap > 0: scores -> softcap * tanh(scores / softcap), Gemma 2).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace py = pybind11;

namespace {

// ------------------------------------------------------------------------------------------
// The kernel.

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
};

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
  return round_bf16(round_bf16(sums) * splat(p.scale));
}

struct Item {
  int req, row_begin, row_end;  // rows relative to the request's first query row
  int head_begin, head_end;     // kv heads
};

// Per-thread rows of every score of an item (bf16 q): [nvec][stride], grown, never shrunk.
TRILLM_INLINE float* score_rows(int nvec, int stride) {
  static thread_local std::vector<float> rows;
  const size_t need = static_cast<size_t>(nvec) * stride;
  if (rows.size() < need) rows.resize(need);
  return rows.data();
}

// The eight scores row[i .. i+8) of which only the first n < 8 exist; the rest -inf.
TRILLM_INLINE v8f load_tail(const float* row, int n) {
  alignas(32) float t[8];
  for (int u = 0; u < 8; ++u) t[u] = u < n ? row[u] : -std::numeric_limits<float>::infinity();
  return load8(t);
}

// bf16 q, once every score of an item is known: transformers' eager attention from there on,
// `softmax(scores, dtype=float32).to(bf16)` then `P @ V` as a bf16 matmul (fp32 sums, one
// rounding at the store): p = exp(s - max) * (1 / sum exp), rounded to bf16 (torch's softmax
// multiplies by the reciprocal), acc = sum_t p_t v_t in fp32. An online softmax cannot round p:
// the normaliser is known only after the last key, hence two passes.
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
    const int full = n & ~7;
    v8f mx = splat(-std::numeric_limits<float>::infinity());
    for (int i = 0; i < full; i += 8) {
      const v8f x = load8(row + i);
      mx = mx > x ? mx : x;
    }
    if (full < n) {
      const v8f x = load_tail(row + full, n - full);
      mx = mx > x ? mx : x;
    }
    const v8f shift = splat(hmax(mx));
    v8f sum = splat(0.0f);
    alignas(32) float tail[8];
    for (int i = 0; i < n; i += 8) {  // the tail's -inf lanes: exactly 0
      const v8f e = exp_nonpositive((i < full ? load8(row + i) : load_tail(row + i, n - i)) - shift);
      if (i < full) std::memcpy(row + i, &e, sizeof(e));
      else std::memcpy(tail, &e, sizeof(e));
      sum += e;
    }
    const v8f inv = splat(1.0f / hsum(sum));
    for (int i = 0; i < n; i += 8) {
      const v8f w = round_bf16((i < full ? load8(row + i) : load8(tail)) * inv);
      if (i < full) std::memcpy(row + i, &w, sizeof(w));
      else std::memcpy(row + i, &w, (n - i) * sizeof(float));
    }
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

// NV = head_dim / 8 when known at compile time (register-resident rows), 0 = read at run time.
template <typename T, typename C, int NV_FIXED>
TRILLM_INLINE void attend_item(const Problem& p, const Item& it) {
  const int NV = NV_FIXED > 0 ? NV_FIXED : p.head_dim / 8;
  const int D = p.head_dim;
  const int group = p.num_heads / p.num_kv_heads;
  const int heads = it.head_end - it.head_begin;  // kv heads of this item
  const int per_row = heads * group;               // query vectors per query row
  const int q0 = p.query_start_loc[it.req];
  const int query_len = p.query_start_loc[it.req + 1] - q0;
  const int context = p.seq_lens[it.req] - query_len;  // keys before the first query row
  // Vector v: row it.row_begin + v / per_row, query head it.head_begin * group + v % per_row.
  const int nvec = (it.row_end - it.row_begin) * per_row;
  const int key_end = context + it.row_end;  // keys the tile's last row sees
  const int32_t* blocks = p.block_table + static_cast<int64_t>(it.req) * p.block_table_stride;
  const T* q = static_cast<const T*>(p.q);
  const C* kc = static_cast<const C*>(p.k_cache);
  const C* vc = static_cast<const C*>(p.v_cache);
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Per-thread scratch: large stack frames would be probed page by page on every item.
  alignas(32) static thread_local v8f qv[kMaxLanes];   // [nvec][NV], times q_scale<T>
  alignas(32) static thread_local v8f acc[kMaxLanes];  // [nvec][NV]
  float m[kMaxVectors], l[kMaxVectors];
  int limit[kMaxVectors];    // last key position vector v may see
  int lower[kMaxVectors];    // first key position vector v may see (sliding window)
  int64_t off[kMaxVectors];  // vector v's kv head within a cache slot

  for (int v = 0; v < nvec; ++v) {
    const int row = it.row_begin + v / per_row;
    const int head = it.head_begin * group + v % per_row;
    const T* src = q + (q0 + row) * p.q_token_stride + head * p.q_head_stride;
    for (int j = 0; j < NV; ++j) {
      qv[v * NV + j] = load8(src + 8 * j) * splat(q_scale<T>(p));
      acc[v * NV + j] = splat(0.0f);
    }
    m[v] = neg_inf;
    l[v] = 0.0f;
    limit[v] = context + row;
    lower[v] = p.window > 0 ? std::max(0, limit[v] - p.window + 1) : 0;
    off[v] = static_cast<int64_t>(head / group) * D;
  }

  // Slot rows of keys start .. start + n (a slot row holds every kv head: contiguous).
  auto slot_rows = [&](int start, int n, const C** kr, const C** vr) {
    int b = start / p.block_size, o = start % p.block_size;
    for (int t = 0; t < n; ++t) {
      const int64_t slot = static_cast<int64_t>(blocks[b]) * p.block_size + o;
      kr[t] = kc + slot * slot_elems;
      vr[t] = vc + slot * slot_elems;
      if (++o == p.block_size) o = 0, ++b;
    }
  };
  const C* kp[kKeyChunk];
  const C* vp[kKeyChunk];
  const C* kn[kKeyChunk];
  const C* vn[kKeyChunk];
  alignas(32) float s[kKeyChunk];
  const int row_bytes = static_cast<int>(slot_elems * sizeof(C));
  const int head_bytes = static_cast<int>(D * sizeof(C));
  // The window's start for the tile's first row: keys before it no row of the tile sees.
  const int key_begin = p.window > 0 ? std::max(0, context + it.row_begin - p.window + 1) : 0;
  // bf16 q: every score kept for the second pass ([nvec][stride], keys key_begin + i).
  const int stride = key_end - key_begin;
  float* all = kBf16Scores<T> ? score_rows(nvec, stride) : nullptr;
  for (int start = key_begin; start < key_end; start += kKeyChunk) {
    const int n = std::min(kKeyChunk, key_end - start);
    slot_rows(start, n, kp, vp);
    // Prefetch the next chunk's rows (only this item's heads).
    const int next_n = std::min(kKeyChunk, key_end - start - n);
    slot_rows(start + n, next_n, kn, vn);
    const int first = it.head_begin * head_bytes, last = it.head_end * head_bytes;
    for (int t = 0; t < next_n; ++t) {
      const char* kr = reinterpret_cast<const char*>(kn[t]);
      const char* vr = reinterpret_cast<const char*>(vn[t]);
      for (int b = first; b < last && b < row_bytes; b += 64) {
        __builtin_prefetch(kr + b);
        __builtin_prefetch(vr + b);
      }
    }
    for (int v = 0; v < nvec; ++v) {
      const v8f* qrow = qv + v * NV;
      const int64_t h = off[v];
      // Scores, eight keys at a time (independent accumulators, one tree reduction). Past the
      // chunk's end the last key is read again; those lanes are masked below.
      for (int t = 0; t < n; t += 8) {
        const C* k[8];
        for (int i = 0; i < 8; ++i) k[i] = kp[std::min(t + i, n - 1)] + h;
        v8f a[8];
        for (int i = 0; i < 8; ++i) a[i] = splat(0.0f);
        for (int j = 0; j < NV; ++j) {
          const v8f qj = qrow[j];
          for (int i = 0; i < 8; ++i) a[i] += qj * load8(k[i] + 8 * j);
        }
        const v8f sums = finish_scores<T>(sum_lanes8(a), p);
        std::memcpy(s + t, &sums, sizeof(sums));
      }
      if (kBf16Scores<T>) {  // softmax and P @ V after the last chunk
        std::memcpy(all + static_cast<int64_t>(v) * stride + (start - key_begin), s,
                    n * sizeof(float));
        continue;
      }
      // Causal limit, and -inf padding up to the chunk size; the window's lower bound.
      const int visible = std::max(0, std::min(n, limit[v] - start + 1));
      const int hidden = std::min(visible, std::max(0, lower[v] - start));
      if (visible == hidden) continue;  // nothing this row may see in this chunk
      if (p.softcap > 0.0f) soft_cap(s + hidden, visible - hidden, p.softcap);
      for (int u = 0; u < hidden; ++u) s[u] = neg_inf;
      for (int u = visible; u < kKeyChunk; ++u) s[u] = neg_inf;
      float chunk_max = m[v];
      for (int g = 0; g < kKeyChunk / 8; ++g) chunk_max = std::max(chunk_max, hmax(load8(s + 8 * g)));
      const float correction = std::exp(m[v] - chunk_max);  // 0 the first time (m = -inf)
      v8f sum8 = splat(0.0f);
      for (int g = 0; g < kKeyChunk / 8; ++g) {
        const v8f e = exp_nonpositive(load8(s + 8 * g) - splat(chunk_max));
        std::memcpy(s + 8 * g, &e, sizeof(e));
        sum8 += e;
      }
      l[v] = l[v] * correction + hsum(sum8);
      m[v] = chunk_max;
      // acc = acc * correction + sum_t w_t v_t, the row kept in registers when NV is fixed.
      v8f r[NV_FIXED > 0 ? NV_FIXED : kMaxHeadDim / 8];
      v8f* a = acc + v * NV;
      for (int j = 0; j < NV; ++j) r[j] = a[j] * splat(correction);
      for (int u = 0; u < visible; ++u) {
        const v8f w = splat(s[u]);
        const C* val = vp[u] + h;
        for (int j = 0; j < NV; ++j) r[j] += w * load8(val + 8 * j);
      }
      for (int j = 0; j < NV; ++j) a[j] = r[j];
    }
  }
  if (kBf16Scores<T>) {
    rounded_softmax_pv<C, NV_FIXED>(p, nvec, all, stride, key_begin, key_end, lower, limit, off,
                                    acc, [&](int start, int n, const C** vr) {
                                      const C* kr[kKeyChunk];
                                      slot_rows(start, n, kr, vr);
                                    });
    for (int v = 0; v < nvec; ++v) l[v] = 1.0f;  // acc is the output
  }

  T* out = static_cast<T*>(p.out);
  for (int v = 0; v < nvec; ++v) {
    const int row = it.row_begin + v / per_row;
    const int head = it.head_begin * group + v % per_row;
    T* dst = out + (q0 + row) * p.out_token_stride + head * p.out_head_stride;
    const v8f inv = splat(1.0f / l[v]);  // l >= 1: a row always sees at least its own key
    for (int j = 0; j < NV; ++j) {
      const v8f x = acc[v * NV + j] * inv;
      for (int d = 0; d < 8; ++d) store(dst + 8 * j + d, x[d]);
    }
  }
}

// A one-row tile (every decode step's items). Keys are taken a chunk of kDecodeChunk at a time
// (eight groups of eight slots): (0) one load per 64-byte line of the chunk's K and V rows brings
// them into L2 in one burst of independent misses; (1) the chunk's scores q . k, eight slots at
// a time with one transposing add tree per eight, into a per-thread row per query vector;
// (2) per query vector one online-softmax update for the whole chunk (a max, a correction, a
// vectorised exp); (3) acc = acc * correction + sum_t w_t v_t.
// Why the burst: interleaved with the math, the misses of a one-row tile overlap badly on this
// VM (prefetch instructions 1-8 groups ahead did not help); loading first, measured
// alternately in one process (2 threads, batch 53 x 256 keys, 1 GB cache): contiguous blocks
// 20.8 against 18.0 GB/s for the per-8-slot online softmax this replaces, random blocks 16.9
// against 14.7 (a plain read of the same rows: 24-29).
constexpr int kDecodeGroup = 8;
constexpr int kDecodeChunk = 64;
thread_local volatile float touch_sink;  // keeps the touching loads

template <typename T, typename C, int NV>
TRILLM_INLINE void attend_decode(const Problem& p, const Item& it) {
  constexpr int D = NV * 8;
  const int group = p.num_heads / p.num_kv_heads;
  const int heads = it.head_end - it.head_begin;
  const int nvec = heads * group;  // query vector v: query head it.head_begin * group + v
  const int q0 = p.query_start_loc[it.req];
  const int query_len = p.query_start_loc[it.req + 1] - q0;
  const int row = it.row_begin;
  const int key_end = p.seq_lens[it.req] - query_len + row + 1;  // keys .. its own position
  const int key_begin = p.window > 0 ? std::max(0, key_end - p.window) : 0;
  const int32_t* blocks = p.block_table + static_cast<int64_t>(it.req) * p.block_table_stride;
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t first = static_cast<int64_t>(it.head_begin) * D;  // the item's heads in a row
  const int span_bytes = static_cast<int>(heads * D * sizeof(C));
  const C* kc = static_cast<const C*>(p.k_cache) + first;
  const C* vc = static_cast<const C*>(p.v_cache) + first;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int groups = (key_end - key_begin + kDecodeGroup - 1) / kDecodeGroup;
  // bf16 q: every score kept for the second pass ([nvec][stride], keys key_begin + i).
  const int stride = groups * kDecodeGroup;
  float* all = kBf16Scores<T> ? score_rows(nvec, stride) : nullptr;

  alignas(32) static thread_local v8f qv[kMaxLanes];   // [nvec][NV], times q_scale<T>
  alignas(32) static thread_local v8f acc[kMaxLanes];  // [nvec][NV]
  alignas(32) static thread_local float scores[kMaxVectors * kDecodeChunk];  // [nvec][chunk]
  float m[kMaxVectors], l[kMaxVectors];
  const T* q = static_cast<const T*>(p.q) + (q0 + row) * p.q_token_stride;
  for (int v = 0; v < nvec; ++v) {
    const T* src = q + (it.head_begin * group + v) * p.q_head_stride;
    for (int j = 0; j < NV; ++j) {
      qv[v * NV + j] = load8(src + 8 * j) * splat(q_scale<T>(p));
      acc[v * NV + j] = splat(0.0f);
    }
    m[v] = neg_inf;
    l[v] = 0.0f;
  }

  // Slot offsets (in elements) of keys key_begin + g * 8 .. + 7, past key_end repeating the
  // last key (their scores are masked, their weights 0).
  auto group_slots = [&](int g, int64_t* slot) {
    for (int i = 0; i < kDecodeGroup; ++i) {
      const int key = std::min(key_begin + g * kDecodeGroup + i, key_end - 1);
      slot[i] = (static_cast<int64_t>(blocks[key / p.block_size]) * p.block_size +
                 key % p.block_size) * slot_elems;
    }
  };
  constexpr int kGroups = kDecodeChunk / kDecodeGroup;
  int64_t slots[kGroups][kDecodeGroup];
  for (int g0 = 0; g0 < groups; g0 += kGroups) {
    const int ng = std::min(kGroups, groups - g0);
    const int width = ng * kDecodeGroup;
    // (0) Touch the chunk's rows: one load a line (the sum only keeps the loads).
    v8f sink = splat(0.0f);
    for (int c = 0; c < ng; ++c) {
      group_slots(g0 + c, slots[c]);
      for (int i = 0; i < kDecodeGroup; ++i) {
        const C* kr = kc + slots[c][i];
        const C* vr = vc + slots[c][i];
        for (int b = 0; b < span_bytes / static_cast<int>(sizeof(C)); b += 64 / sizeof(C))
          sink += load8(kr + b) + load8(vr + b);
      }
    }
    touch_sink = sink[0];
    // (1) Scores of the chunk.
    for (int c = 0; c < ng; ++c) {
      const int64_t* slot = slots[c];
      for (int v = 0; v < nvec; ++v) {
        const int64_t h = (v / group) * D;
        const v8f* qr = qv + v * NV;
        v8f a[kDecodeGroup];
        for (int i = 0; i < kDecodeGroup; ++i) {
          const C* k = kc + slot[i] + h;
          v8f x = qr[0] * load8(k);
          for (int j = 1; j < NV; ++j) x += qr[j] * load8(k + 8 * j);
          a[i] = x;
        }
        const v8f sums = finish_scores<T>(sum_lanes8(a), p);
        float* dst = kBf16Scores<T> ? all + static_cast<int64_t>(v) * stride +
                                          (g0 + c) * kDecodeGroup
                                    : scores + v * kDecodeChunk + c * kDecodeGroup;
        std::memcpy(dst, &sums, sizeof(sums));
      }
    }
    if (kBf16Scores<T>) continue;  // softmax and P @ V after the last chunk
    const int valid = std::min(width, key_end - key_begin - g0 * kDecodeGroup);
    for (int v = 0; v < nvec; ++v) {
      // (2) Online softmax over the chunk.
      float* s = scores + v * kDecodeChunk;
      if (p.softcap > 0.0f) soft_cap(s, valid, p.softcap);
      for (int t = valid; t < width; ++t) s[t] = neg_inf;
      v8f mx = splat(m[v]);
      for (int t = 0; t < width; t += kDecodeGroup) {
        const v8f x = load8(s + t);
        mx = mx > x ? mx : x;
      }
      const float chunk_max = hmax(mx);
      const v8f shift = splat(chunk_max);
      v8f sum = splat(0.0f);
      for (int t = 0; t < width; t += kDecodeGroup) {
        const v8f e = exp_nonpositive(load8(s + t) - shift);
        std::memcpy(s + t, &e, sizeof(e));
        sum += e;
      }
      const float correction = exp_nonpositive(splat(m[v] - chunk_max))[0];  // 0 at first
      l[v] = l[v] * correction + hsum(sum);
      m[v] = chunk_max;
      // (3) acc = acc * correction + sum_t w_t v_t.
      const int64_t h = (v / group) * D;
      v8f r[NV];
      for (int j = 0; j < NV; ++j) r[j] = acc[v * NV + j] * splat(correction);
      for (int c = 0; c < ng; ++c) {
        const float* w = s + c * kDecodeGroup;
        for (int i = 0; i < kDecodeGroup; ++i) {
          const v8f wi = splat(w[i]);
          const C* val = vc + slots[c][i] + h;
          for (int j = 0; j < NV; ++j) r[j] += wi * load8(val + 8 * j);
        }
      }
      for (int j = 0; j < NV; ++j) acc[v * NV + j] = r[j];
    }
  }
  if (kBf16Scores<T>) {
    int lo[kMaxVectors], hi[kMaxVectors];
    int64_t off[kMaxVectors];
    for (int v = 0; v < nvec; ++v) lo[v] = key_begin, hi[v] = key_end - 1, off[v] = (v / group) * D;
    rounded_softmax_pv<C, NV>(p, nvec, all, stride, key_begin, key_end, lo, hi, off, acc,
                              [&](int start, int n, const C** vr) {
                                for (int t = 0; t < n; ++t) {
                                  const int key = start + t;
                                  vr[t] = vc + (static_cast<int64_t>(blocks[key / p.block_size]) *
                                                    p.block_size + key % p.block_size) * slot_elems;
                                }
                              });
    for (int v = 0; v < nvec; ++v) l[v] = 1.0f;  // acc is the output
  }

  T* out = static_cast<T*>(p.out) + (q0 + row) * p.out_token_stride;
  for (int v = 0; v < nvec; ++v) {
    T* dst = out + (it.head_begin * group + v) * p.out_head_stride;
    const v8f inv = splat(1.0f / l[v]);  // l >= 1: the max's own term is exp(0)
    for (int j = 0; j < NV; ++j) {
      const v8f x = acc[v * NV + j] * inv;
      for (int d = 0; d < 8; ++d) store(dst + 8 * j + d, x[d]);
    }
  }
}

template <typename T, typename C>
TRILLM_INLINE void attend_dispatch(const Problem& p, const Item& it) {
  const bool one_row = it.row_end - it.row_begin == 1;
  switch (p.head_dim) {
    case 64:
      return one_row ? attend_decode<T, C, 8>(p, it) : attend_item<T, C, 8>(p, it);
    case 128:
      return one_row ? attend_decode<T, C, 16>(p, it) : attend_item<T, C, 16>(p, it);
    default:
      return attend_item<T, C, 0>(p, it);
  }
}

template <typename T, typename C>
void attend_generic(const Problem& p, const Item& it) {
  attend_dispatch<T, C>(p, it);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename T, typename C>
__attribute__((target("avx2,fma"))) void attend_avx2(const Problem& p, const Item& it) {
  attend_dispatch<T, C>(p, it);
}
#endif

using Kernel = void (*)(const Problem&, const Item&);

template <typename T, typename C>
Kernel select_kernel() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx2 = cpu_has_avx2();
  if (avx2) return &attend_avx2<T, C>;
#endif
  return &attend_generic<T, C>;
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
  }

  // dtype (q, out): 0 = float32, 1 = bfloat16; cache_dtype: 0, 1, or 2 = fp8 e4m3 (values
  // stored as x / scale with the scale 1.0: read as they are).
  void run(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache,
           int64_t q_token_stride, int64_t q_head_stride, int64_t out_token_stride,
           int64_t out_head_stride, float scale, int dtype, int window, float softcap,
           int cache_dtype) const {
    if (dtype != 0 && dtype != 1) throw std::invalid_argument("dtype must be float32 or bfloat16");
    if (window < 0 || !(softcap >= 0.0f))
      throw std::invalid_argument("window and softcap must be >= 0 (0: none)");
    if (cache_dtype < 0 || cache_dtype > 2)
      throw std::invalid_argument("cache_dtype must be float32, bfloat16 or fp8");
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
    const Kernel kernel =
        dtype == 0 ? select_for_cache<float>(cache_dtype) : select_for_cache<Bf16>(cache_dtype);
    const int n = static_cast<int>(items_.size());
    py::gil_scoped_release release;
    run_items(num_threads_, n, [&](int i) { kernel(p, items_[i]); });
  }

 private:
  Problem p_{};
  std::vector<Item> items_;
  int num_threads_;
};

}  // namespace

void register_cpu_attention(py::module_& m) {
  m.doc() = "Paged attention on CPU, reading K/V in place from the block-paged cache.";
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
           py::arg("cache_dtype") = 0);
}
