// Stage 7 (model forward) on CPU, fresh prompts: causal self-attention of prompt chunks that
// have no context in the cache (a whole prompt in one step, the common prefill case), read
// straight from this step's q/k/v (views of the fused qkv projection), fp32.
//
// Why not torch's scaled_dot_product_attention(is_causal=True): its CPU flash kernel runs at
// 25-55 GFLOP/s of causal attention math on the bench model's shapes (2 threads), a third of
// what the same cores do in a GEMM; this one at 50-93 (1.6-2.0x; 5 prompts of 384 rows, 8 query
// and 4 kv heads of 64: 8.1 against 13.9 ms). It is written like the packed GEMM
// (ext/cpu_gemm.cpp): per work item -- a segment, a kv head, a block of query positions with
// every query head of the group -- the scores of a tile of 64 keys are a GEMM S = Q . K^T on a
// 6 x 16 register block (K^T packed into 16-key panels by 8 x 8 transposes), an online softmax
// runs over S's rows in place, and O += P . V is a second GEMM on the same block shape (the V
// tile packed into 16-column panels: its rows, 4 KiB apart in a fused qkv, would share a few L1
// sets). Scores past a row's own position are masked (-inf); panels past a register block's last
// position and tiles past the item's last position are never computed.
//
// Contract (trillm/attention/backend.py): segment s owns rows start_s .. start_s + len_s of q,
// k, v and out; row i of it attends to rows 0 .. i of the same segment; query head h reads kv
// head h / (Hq / Hkv). AVX2 + FMA only (`prefill_supported()`); callers fall back to SDPA.
//
// bf16 q/k/v/out (a bf16 model): what transformers' bf16 eager attention computes, as the
// paged kernel's bf16 path does (ext/cpu_attention.cpp), with the same rounding points
// (ext/cpu_attention_bf16.h): scores q . k rounded to bf16, times the scale, rounded again; then
// two passes instead of the online softmax, every score of the item kept: per row max, sum of
// exp, p = exp * (1 / sum) rounded to bf16, then O = P . V in fp32 rounded once at the store
// (attend_item_bf16).
#include <pybind11/pybind11.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "cpu_attention_avx2_tiles.h"  // the tiles: packing, products, the bf16 passes
#include "cpu_attention_bf16.h"
#include "cpu_common.h"
#include "cpu_program.h"

namespace py = pybind11;

namespace {

constexpr int kMaxVectors = kTileMaxVectors;  // query vectors (positions x heads) per item
constexpr int kMaxHeadDim = kTileMaxHeadDim;  // head_dim: a multiple of 16 up to this

struct Problem {
  const void* q;  // float or Bf16, as k, v and out
  const void* k;
  const void* v;
  void* out;
  int64_t q_token_stride, q_head_stride;
  int64_t k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride;
  int64_t out_token_stride, out_head_stride;
  int num_heads, num_kv_heads, head_dim;
  float scale;
};

struct Item {
  int start;   // the segment's first row
  int kv_head;
  int first, last;  // query positions first .. last - 1 of the segment
  int seg;          // the segment's index
};

// What the two bf16 kernels of an item (attend_item_bf16 below; attend_item_bf16_dp on
// AVX512-BF16) share around their passes: vector i at position first + i / group of query head
// kv_head * group + i % group, where its q and output are, and a tile's rows of keys or values.
struct FreshBf16Item {
  const Problem& p;
  const Item& it;
  int D, group, M;
  const Bf16* k;  // the segment's first key row of this kv head; v: value
  const Bf16* v;
  int pos[kMaxVectors];
  const Bf16* rows[kKeyTile];

  FreshBf16Item(const Problem& p_, const Item& it_) : p(p_), it(it_) {
    D = p.head_dim;
    group = p.num_heads / p.num_kv_heads;
    M = (it.last - it.first) * group;
    k = static_cast<const Bf16*>(p.k) + it.start * p.k_token_stride + it.kv_head * p.k_head_stride;
    v = static_cast<const Bf16*>(p.v) + it.start * p.v_token_stride + it.kv_head * p.v_head_stride;
    for (int i = 0; i < M; ++i) pos[i] = it.first + i / group;
  }
  int head(int i) const { return it.kv_head * group + i % group; }
  const Bf16* q_row(int i) const {
    return static_cast<const Bf16*>(p.q) + (it.start + pos[i]) * p.q_token_stride +
           head(i) * p.q_head_stride;
  }
  // Keys (values false) or values key0 .. key0 + n -> their n row pointers (until the next call).
  const Bf16* const* operator()(bool values, int key0, int n) {
    const Bf16* base = values ? v : k;
    const int64_t ld = values ? p.v_token_stride : p.k_token_stride;
    for (int t = 0; t < n; ++t) rows[t] = base + (key0 + t) * ld;
    return rows;
  }
  Bf16* out_row(int i) const {
    return static_cast<Bf16*>(p.out) + (it.start + pos[i]) * p.out_token_stride +
           head(i) * p.out_head_stride;
  }
  // acc [M][D] -> the output rows, rounded once.
  void store_rows(const float* acc) const {
    for (int i = 0; i < M; ++i) {
      Bf16* dst = out_row(i);
      for (int d = 0; d < D; ++d) store(dst + d, acc[i * D + d]);
    }
  }
};

#pragma GCC push_options
#pragma GCC target("avx2,fma")

void attend_item(const Problem& p, const Item& it) {
  const int D = p.head_dim;
  const int group = p.num_heads / p.num_kv_heads;
  const int M = (it.last - it.first) * group;  // vector i: position first + i / group
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Per-thread scratch (large stack frames would be probed page by page on every item).
  alignas(32) static thread_local float qs[kMaxVectors * kMaxHeadDim];  // [M][D], scaled
  alignas(32) static thread_local float acc[kMaxVectors * kMaxHeadDim];  // [M][D]
  alignas(32) static thread_local float s[kMaxVectors * kKeyTile];  // [M][tile]: S, then P
  alignas(32) static thread_local float kp[kKeyTile * kMaxHeadDim];  // K^T panels
  alignas(32) static thread_local float vp[kKeyTile * kMaxHeadDim];  // V panels
  float m[kMaxVectors], l[kMaxVectors], corr[kMaxVectors];
  int pos[kMaxVectors];

  const __m256 scale = _mm256_set1_ps(p.scale);
  for (int i = 0; i < M; ++i) {
    pos[i] = it.first + i / group;
    const int head = it.kv_head * group + i % group;
    const float* src = static_cast<const float*>(p.q) + (it.start + pos[i]) * p.q_token_stride +
                       head * p.q_head_stride;
    for (int d = 0; d < D; d += 8) {
      _mm256_store_ps(qs + i * D + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), scale));
      _mm256_store_ps(acc + i * D + d, _mm256_setzero_ps());
    }
    m[i] = neg_inf;
    l[i] = 0.0f;
  }
  const float* k = static_cast<const float*>(p.k) + it.start * p.k_token_stride +
                   it.kv_head * p.k_head_stride;
  const float* v = static_cast<const float*>(p.v) + it.start * p.v_token_stride +
                   it.kv_head * p.v_head_stride;

  for (int key0 = 0; key0 < it.last; key0 += kKeyTile) {
    const int n = std::min(kKeyTile, it.last - key0);
    const int width = (n + kPanel - 1) / kPanel * kPanel;  // score columns written
    pack_keys([k, key0, &p](int t) { return k + (key0 + t) * p.k_token_stride; }, n, D, kp);
    // Scores of the panels some vector of the block sees (the rest is masked below).
    for (int i = 0; i < M; i += kRows) {
      const int rows = std::min(kRows, M - i);
      const int seen = std::min(width, pos[i + rows - 1] - key0 + 1);
      with_rows(rows, [&](auto r) {
        for (int c = 0; c < seen; c += kPanel)
          scores<decltype(r)::value>(qs + i * D, D, kp + c * D, s + i * kKeyTile + c);
      });
    }
    // Online softmax over the tile, row by row; P replaces S in place. Columns from the row's
    // first invisible key to `width` become 0 (the block's later vectors may read them).
    for (int i = 0; i < M; ++i) {
      float* row = s + i * kKeyTile;
      const int visible = std::min(n, pos[i] - key0 + 1);
      if (visible <= 0) {  // the whole tile is after this position
        for (int c = 0; c < width; c += 8) _mm256_storeu_ps(row + c, _mm256_setzero_ps());
        corr[i] = 1.0f;
        continue;
      }
      const int full = visible & ~7;  // whole vectors of visible scores; then a partial one
      __m256 mx = _mm256_set1_ps(m[i]);
      for (int c = 0; c < full; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + c));
      __m256 tail = _mm256_setzero_ps();
      if (full < visible) {  // lanes >= visible - full: -inf
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 keep = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(visible - full), lanes));
        tail = _mm256_blendv_ps(_mm256_set1_ps(neg_inf), _mm256_loadu_ps(row + full), keep);
        mx = _mm256_max_ps(mx, tail);
      }
      mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 0x01));
      mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, _MM_SHUFFLE(1, 0, 3, 2)));
      mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, _MM_SHUFFLE(2, 3, 0, 1)));
      const float tile_max = _mm256_cvtss_f32(mx);
      const v8f shift = splat(tile_max);
      v8f sum = splat(0.0f);
      for (int c = 0; c < full; c += 8) {
        const v8f e = exp_nonpositive(load8(row + c) - shift);
        std::memcpy(row + c, &e, sizeof(e));
        sum += e;
      }
      int c = full;
      if (full < visible) {
        const v8f e = exp_nonpositive(v8f(tail) - shift);
        std::memcpy(row + c, &e, sizeof(e));
        sum += e;
        c += 8;
      }
      for (; c < width; c += 8) _mm256_storeu_ps(row + c, _mm256_setzero_ps());
      corr[i] = exp_nonpositive(splat(m[i] - tile_max))[0];  // 0 the first time (m = -inf)
      l[i] = l[i] * corr[i] + hsum(sum);
      m[i] = tile_max;
    }
    // O = O * corr + P . V over the keys the block's last vector sees.
    pack_values([v, key0, &p](int t) { return v + (key0 + t) * p.v_token_stride; }, n, D, vp);
    for (int i = 0; i < M; i += kRows) {
      const int rows = std::min(kRows, M - i);
      const int keys = std::min(n, pos[i + rows - 1] - key0 + 1);
      if (keys <= 0) continue;  // corr is 1 and P is 0 for every vector of the block
      with_rows(rows, [&](auto r) {
        for (int c = 0; c < D; c += kPanel)
          accumulate<decltype(r)::value>(s + i * kKeyTile, vp + c * n, kPanel, keys, corr + i,
                                         acc + i * D + c, D);
      });
    }
  }

  for (int i = 0; i < M; ++i) {
    const int head = it.kv_head * group + i % group;
    float* dst = static_cast<float*>(p.out) + (it.start + pos[i]) * p.out_token_stride +
                 head * p.out_head_stride;
    const __m256 inv = _mm256_set1_ps(1.0f / l[i]);  // l >= 1: a row always sees its own key
    for (int d = 0; d < D; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_load_ps(acc + i * D + d), inv));
  }
}

// bf16: every score of the item first ([M][stride], keys 0 .. last - 1), then per row the
// rounded softmax, then O = P . V (bf16_item_tiles, ext/cpu_attention_avx2_tiles.h).
void attend_item_bf16(const Problem& p, const Item& it) {
  FreshBf16Item item(p, it);
  bf16_attend_item(item, p.scale);
}

#pragma GCC pop_options

}  // namespace

#include "cpu_prefill_attention_dp.h"

namespace {

// Whether bf16 items run on vdpbf16ps (AVX512-BF16 here, not turned off by set_bf16_dot).
inline bool cpu_has_avx512bf16_dot() { return cpu_has_avx512bf16(); }
std::atomic<bool> bf16_dot{cpu_has_avx512bf16_dot()};

bool set_bf16_dot(bool on) {
  const bool before = bf16_dot.load();
  bf16_dot.store(on && cpu_has_avx512bf16_dot());
  return before;
}

// Off: each vdpbf16ps item packs its own key / value tiles (benchmarks, tests: the same bits).
std::atomic<bool> shared_pack{true};

bool prefill_supported() { return cpu_has_avx2(); }

// segments: num_segments x (start row, length) int32 pairs.
void causal_prefill(uintptr_t out, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t segments,
                    int num_segments, int64_t q_token_stride, int64_t q_head_stride,
                    int64_t k_token_stride, int64_t k_head_stride, int64_t v_token_stride,
                    int64_t v_head_stride, int64_t out_token_stride, int64_t out_head_stride,
                    int num_heads, int num_kv_heads, int head_dim, float scale,
                    int num_threads, int dtype) {
  static const bool avx2 = cpu_has_avx2();
  if (!avx2) throw std::runtime_error("causal_prefill needs a CPU with AVX2 and FMA");
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0)
    throw std::invalid_argument("num_heads must be a multiple of num_kv_heads");
  const int group = num_heads / num_kv_heads;
  if (group > kMaxVectors) throw std::invalid_argument("more than 96 query heads per kv head");
  if (head_dim <= 0 || head_dim > kMaxHeadDim || head_dim % kPanel != 0)
    throw std::invalid_argument("head_dim must be a multiple of 16 in 16..256");
  if (dtype != 0 && dtype != 1) throw std::invalid_argument("dtype must be float32 or bfloat16");
  const Problem p{reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
                  reinterpret_cast<const void*>(v), reinterpret_cast<void*>(out),
                  q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride,
                  v_head_stride, out_token_stride, out_head_stride, num_heads, num_kv_heads,
                  head_dim, scale};
  // Items: (segment, kv head, block of positions), the most work (latest blocks) first so
  // the threads finish together.
  const int block = std::max(1, kMaxVectors / group);
  const int32_t* seg = reinterpret_cast<const int32_t*>(segments);
  std::vector<Item> items;
  for (int s = 0; s < num_segments; ++s) {
    const int start = seg[2 * s], len = seg[2 * s + 1];
    if (start < 0 || len < 0) throw std::invalid_argument("negative segment start or length");
    for (int first = 0; first < len; first += block)
      for (int h = 0; h < num_kv_heads; ++h)
        items.push_back({start, h, first, std::min(len, first + block), s});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return static_cast<int64_t>(a.last) * (a.last - a.first) >
           static_cast<int64_t>(b.last) * (b.last - b.first);
  });
  const int n = static_cast<int>(items.size());
  py::gil_scoped_release release;
  if (dtype == 1 && bf16_dot.load() && shared_pack.load())
    run_bf16_dp_shared(p, items, seg, num_segments, num_threads);
  else if (dtype == 1 && bf16_dot.load())
    run_items(num_threads, n, [&](int i) { attend_item_bf16_dp(p, items[i]); });
  else if (dtype == 1)
    run_items(num_threads, n, [&](int i) { attend_item_bf16(p, items[i]); });
  else
    run_items(num_threads, n, [&](int i) { attend_item(p, items[i]); });
}

}  // namespace

void register_cpu_prefill_attention(py::module_& m) {
  m.def("prefill_bf16_dot", &set_bf16_dot, py::arg("on"),
        "bf16 prompts on AVX512-BF16's vdpbf16ps (on where the CPU has it) or the AVX2 path; "
        "-> the setting before. For tests and benchmarks comparing the two.");
  m.def(
      "prefill_shared_pack", [](bool on) { return shared_pack.exchange(on); }, py::arg("on"),
      "vdpbf16ps items read each kv head's tiles packed once per call (on) or pack their own; "
      "-> the setting before. For tests and benchmarks.");
  m.def("prefill_supported", &prefill_supported,
        "Whether causal_prefill runs here (a CPU with AVX2 and FMA).");
  trillm_cpu::def_kernel(m, "causal_prefill", &causal_prefill, py::arg("out"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("segments"), py::arg("num_segments"), py::arg("q_token_stride"),
        py::arg("q_head_stride"), py::arg("k_token_stride"), py::arg("k_head_stride"),
        py::arg("v_token_stride"), py::arg("v_head_stride"), py::arg("out_token_stride"),
        py::arg("out_head_stride"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("scale"), py::arg("num_threads"), py::arg("dtype") = 0);
}
