// Stage 9 on CPU: paged attention that reads K/V in place from the block-paged cache.
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
// and bf16 tensors; math in fp32.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <unistd.h>

namespace py = pybind11;

namespace {

// ------------------------------------------------------------------------------------------
// Thread pool: workers sleep on a condition variable between calls; the caller takes items too.

class ThreadPool {
 public:
  explicit ThreadPool(int num_workers) : pid_(getpid()) {
    for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { loop(); });
  }

  int num_workers() const { return static_cast<int>(workers_.size()); }
  pid_t pid() const { return pid_; }

  // Runs fn(0) .. fn(num_items - 1) on the workers and the calling thread; returns when all
  // are done.
  void run(int num_items, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> one_call(run_mu_);  // callers on several threads take turns
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      num_items_ = num_items;
      next_.store(0);
      busy_ = num_workers();
      ++generation_;
    }
    start_.notify_all();
    take_items(fn, num_items);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  void take_items(const std::function<void(int)>& fn, int num_items) {
    for (int i = next_.fetch_add(1); i < num_items; i = next_.fetch_add(1)) fn(i);
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* fn;
      int num_items;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        fn = fn_;
        num_items = num_items_;
      }
      take_items(*fn, num_items);
      {
        std::lock_guard<std::mutex> lock(mu_);
        --busy_;
      }
      done_.notify_one();
    }
  }

  pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  int num_items_ = 0;
  std::atomic<int> next_{0};
  int busy_ = 0;
  uint64_t generation_ = 0;
};

// Never destroyed: its threads block until the process exits. A forked child inherits the
// object but not its threads, so a pool is remade when the pid changes (the old one leaks).
ThreadPool* g_pool = nullptr;
std::mutex g_pool_mu;

ThreadPool* pool_for(int num_threads) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  const int workers = num_threads - 1;
  // NOTE: a new size (torch's thread count changed) also makes a new pool; the old one's
  // threads stay parked. Rare: the runner sets its thread count once.
  if (g_pool == nullptr || g_pool->pid() != getpid() || g_pool->num_workers() != workers) {
    g_pool = new ThreadPool(workers);
  }
  return g_pool;
}

// ------------------------------------------------------------------------------------------
// 8 fp32 lanes (GCC/Clang vector extensions): SSE pairs in the generic build, one AVX2 register
// in the avx2/fma clone of the kernel (see select_kernel).

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

#define TRILLM_INLINE inline __attribute__((always_inline))

struct Bf16 {
  uint16_t bits;
};

TRILLM_INLINE void store(float* p, float x) { *p = x; }
TRILLM_INLINE void store(Bf16* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p->bits = static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, like torch
    p->bits = static_cast<uint16_t>(u >> 16);
  }
}

TRILLM_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
TRILLM_INLINE v8f load8(const Bf16* p) {
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  v8u32 w = __builtin_convertvector(h, v8u32) << 16;
  v8f v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

TRILLM_INLINE v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

TRILLM_INLINE float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#if defined(__clang__)
#define TRILLM_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TRILLM_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// {sum of a[0], ..., sum of a[7]}: a transposing add tree (in-lane shuffles, then one swap of
// 128-bit halves) instead of eight separate horizontal sums.
TRILLM_INLINE v8f sum_lanes8(const v8f* a) {
  v8f b[4], c[2];
  for (int i = 0; i < 4; ++i) {
    const v8f x = a[2 * i], y = a[2 * i + 1];
    b[i] = TRILLM_SHUFFLE(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           TRILLM_SHUFFLE(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const v8f x = b[2 * i], y = b[2 * i + 1];
    c[i] = TRILLM_SHUFFLE(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           TRILLM_SHUFFLE(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return TRILLM_SHUFFLE(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         TRILLM_SHUFFLE(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

TRILLM_INLINE float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x <= 0 (scores minus their running max), lanes equal to -inf give exactly 0.
// Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial; ~1 ulp.
TRILLM_INLINE v8f exp_nonpositive(v8f x) {
  const v8i live = x != splat(-std::numeric_limits<float>::infinity());
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  v8f fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8i n = __builtin_convertvector(fx, v8i);  // truncates toward zero; floor below
  v8f nf = __builtin_convertvector(n, v8f);
  n += nf > fx ? v8i{-1, -1, -1, -1, -1, -1, -1, -1} : v8i{0, 0, 0, 0, 0, 0, 0, 0};
  nf = __builtin_convertvector(n, v8f);
  v8f r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  v8f y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * r * r + r + splat(1.0f);
  v8i bits = (n + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  v8i out;
  v8f e = y * scale;
  std::memcpy(&out, &e, sizeof(out));
  out &= live;
  std::memcpy(&e, &out, sizeof(e));
  return e;
}

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
};

struct Item {
  int req, row_begin, row_end;  // rows relative to the request's first query row
  int head_begin, head_end;     // kv heads
};

// NV = head_dim / 8 when known at compile time (register-resident rows), 0 = read at run time.
template <typename T, int NV_FIXED>
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
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Per-thread scratch: large stack frames would be probed page by page on every item.
  alignas(32) static thread_local v8f qv[kMaxLanes];   // [nvec][NV], pre-scaled by p.scale
  alignas(32) static thread_local v8f acc[kMaxLanes];  // [nvec][NV]
  float m[kMaxVectors], l[kMaxVectors];
  int limit[kMaxVectors];    // last key position vector v may see
  int64_t off[kMaxVectors];  // vector v's kv head within a cache slot

  for (int v = 0; v < nvec; ++v) {
    const int row = it.row_begin + v / per_row;
    const int head = it.head_begin * group + v % per_row;
    const T* src = q + (q0 + row) * p.q_token_stride + head * p.q_head_stride;
    for (int j = 0; j < NV; ++j) {
      qv[v * NV + j] = load8(src + 8 * j) * splat(p.scale);
      acc[v * NV + j] = splat(0.0f);
    }
    m[v] = neg_inf;
    l[v] = 0.0f;
    limit[v] = context + row;
    off[v] = static_cast<int64_t>(head / group) * D;
  }

  // Slot rows of keys start .. start + n (a slot row holds every kv head: contiguous).
  auto slot_rows = [&](int start, int n, const T** kr, const T** vr) {
    int b = start / p.block_size, o = start % p.block_size;
    for (int t = 0; t < n; ++t) {
      const int64_t slot = static_cast<int64_t>(blocks[b]) * p.block_size + o;
      kr[t] = kc + slot * slot_elems;
      vr[t] = vc + slot * slot_elems;
      if (++o == p.block_size) o = 0, ++b;
    }
  };
  const T* kp[kKeyChunk];
  const T* vp[kKeyChunk];
  const T* kn[kKeyChunk];
  const T* vn[kKeyChunk];
  alignas(32) float s[kKeyChunk];
  const int row_bytes = static_cast<int>(slot_elems * sizeof(T));
  const int head_bytes = static_cast<int>(D * sizeof(T));
  for (int start = 0; start < key_end; start += kKeyChunk) {
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
        const T* k[8];
        for (int i = 0; i < 8; ++i) k[i] = kp[std::min(t + i, n - 1)] + h;
        v8f a[8];
        for (int i = 0; i < 8; ++i) a[i] = splat(0.0f);
        for (int j = 0; j < NV; ++j) {
          const v8f qj = qrow[j];
          for (int i = 0; i < 8; ++i) a[i] += qj * load8(k[i] + 8 * j);
        }
        const v8f sums = sum_lanes8(a);
        std::memcpy(s + t, &sums, sizeof(sums));
      }
      // Causal limit, and -inf padding up to the chunk size.
      const int visible = std::max(0, std::min(n, limit[v] - start + 1));
      for (int u = visible; u < kKeyChunk; ++u) s[u] = neg_inf;
      if (visible == 0) continue;  // nothing this row may see in this chunk
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
        const T* val = vp[u] + h;
        for (int j = 0; j < NV; ++j) r[j] += w * load8(val + 8 * j);
      }
      for (int j = 0; j < NV; ++j) a[j] = r[j];
    }
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

template <typename T>
TRILLM_INLINE void attend_dispatch(const Problem& p, const Item& it) {
  switch (p.head_dim) {
    case 64:
      return attend_item<T, 8>(p, it);
    case 128:
      return attend_item<T, 16>(p, it);
    default:
      return attend_item<T, 0>(p, it);
  }
}

template <typename T>
void attend_generic(const Problem& p, const Item& it) {
  attend_dispatch<T>(p, it);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const Problem& p, const Item& it) {
  attend_dispatch<T>(p, it);
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

template <typename T>
void (*select_kernel())(const Problem&, const Item&) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx2 = cpu_has_avx2();
  if (avx2) return &attend_avx2<T>;
#endif
  return &attend_generic<T>;
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

  // dtype: 0 = float32, 1 = bfloat16.
  void run(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache,
           int64_t q_token_stride, int64_t q_head_stride, int64_t out_token_stride,
           int64_t out_head_stride, float scale, int dtype) const {
    if (dtype != 0 && dtype != 1) throw std::invalid_argument("dtype must be float32 or bfloat16");
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
    auto kernel = dtype == 0 ? select_kernel<float>() : select_kernel<Bf16>();
    const int n = static_cast<int>(items_.size());
    py::gil_scoped_release release;
    if (num_threads_ <= 1 || n <= 1) {
      for (const Item& it : items_) kernel(p, it);
      return;
    }
    std::function<void(int)> fn = [&](int i) { kernel(p, items_[i]); };
    pool_for(num_threads_)->run(n, fn);
  }

 private:
  Problem p_{};
  std::vector<Item> items_;
  int num_threads_;
};

}  // namespace

PYBIND11_MODULE(cpu_attention, m) {
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
           py::arg("dtype"));
}
