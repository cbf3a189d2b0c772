// The small elementwise ops of the Llama-family forward on CPU, each fused into one pass over a
// row instead of one torch op (and one temporary) per step of its formula:
//
//   rms_norm            out = weight * dtype(x * rsqrt(mean(x^2) + eps))   (HF Llama numerics)
//   fused_add_rms_norm  residual = dtype(x + residual); x = rms_norm(residual)      (in place)
//   rotary              neox / rotate_half rotation of q and k by their positions   (in place)
//   silu_and_mul        out = dtype(silu(gate)) * up, gate_up = [gate | up] per row
//   reshape_and_cache   this step's K/V rows into their slots of the paged cache
//
// fp32 and bf16 tensors; math in fp32, rounded to the tensor's dtype exactly where the torch
// references (kernels/*_torch.py) round, so bf16 results match them to the bit except through
// the reduction order of the norm's sum and the exp of silu (~1 ulp of fp32). The Python
// wrappers (kernels/*_cpu.py) check shapes and dtypes and pass data pointers with element
// strides. Rows are independent: large inputs are split over the module's thread pool, and a
// row's result never depends on the split (nor on the thread count). The GIL is released
// meanwhile. Each kernel is also compiled for AVX2 (chosen at run time); this file keeps
// products and sums apart (fp-contract=off below), as torch's separate ops round them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "cpu_common.h"
#include "cpu_program.h"

// NOTE: no fused multiply-adds in this file: each product rounds on its own, as in the torch
// references (rotary's x1 * cos - x2 * sin then matches them to the bit).
#pragma GCC optimize("fp-contract=off")

#include "cpu_ops_avx512.h"

namespace py = pybind11;

namespace {

// Below this much work per call the rows run inline: waking the pool's sleeping workers takes
// tens of microseconds on a busy machine. Work is counted in elements of an RMSNorm pass (~0.3 ns
// each here, cache-resident); each op says what a row costs in those units.
constexpr int64_t kMinParallelWork = 1 << 18;
// Chunks of rows per thread (the pool balances them; several per thread absorb a late start).
constexpr int64_t kChunksPerThread = 4;

// ------------------------------------------------------------------------------------------
// Vector helpers beyond cpu_common.h: bf16 rounding of 8 lanes, stores, partial chunks, exp.

// The bits of each lane rounded to bf16 (low 16 bits zero), as cpu_common.h's scalar store.
TRILLM_INLINE v8u32 bf16_bits(v8f x) {
  v8u32 u;
  std::memcpy(&u, &x, sizeof(u));
  const v8u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;  // nearest even
  const v8u32 quiet_nan = (u | 0x00400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

// x rounded to T's precision, kept in fp32 lanes (torch's ``.to(dtype)`` inside a formula).
template <typename T>
TRILLM_INLINE v8f round_to(v8f x) {
  if constexpr (std::is_same_v<T, Bf16>) {
    const v8u32 bits = bf16_bits(x);
    std::memcpy(&x, &bits, sizeof(x));
  }
  return x;
}

TRILLM_INLINE void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof(x)); }
TRILLM_INLINE void store8(Bf16* p, v8f x) {
  const v8u16 h = __builtin_convertvector(bf16_bits(x) >> 16, v8u16);
  std::memcpy(p, &h, sizeof(h));
}

// The first n (1..8) elements at p; lanes n..7 read as 0. The n == 8 branch folds away where
// n is a constant (the full chunks of for_chunks).
template <typename T>
TRILLM_INLINE v8f load_n(const T* p, int n) {
  if (n == 8) return load8(p);
  T buf[8] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load8(buf);
}

template <typename T>
TRILLM_INLINE void store_n(T* p, v8f x, int n) {
  if (n == 8) return store8(p, x);
  T buf[8];
  store8(buf, x);
  std::memcpy(p, buf, n * sizeof(T));
}

// body(i, m) for the 8-lane chunks of [0, n): m = 8, then m = n % 8 for a last partial chunk.
template <typename Body>
TRILLM_INLINE void for_chunks(int64_t n, Body&& body) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) body(i, 8);
  if (i < n) body(i, static_cast<int>(n - i));
}

// The sum of body(i, m) (a v8f per chunk, as for_chunks) over [0, n), in four independent
// accumulators so that the adds overlap. The order depends on n only.
template <typename Body>
TRILLM_INLINE float sum_chunks(int64_t n, Body&& body) {
  v8f acc[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int j = 0; j < 4; ++j) acc[j] += body(i + 8 * j, 8);
  }
  for (; i + 8 <= n; i += 8) acc[0] += body(i, 8);
  if (i < n) acc[1] += body(i, static_cast<int>(n - i));
  return hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

// exp(x) for any x. exp_nonpositive's range reduction (x = n ln2 + r, 2^n built in the
// exponent bits) holds while n <= 127, i.e. up to x ~ 88.37: x in (88, 89] goes through
// exp(x - ln2) * 2, and exp(89) > FLT_MAX overflows to +inf as expf does. Below -87 it returns
// exp(-87) ~ 1.6e-38 (exp_nonpositive's clamp) where expf underflows: nothing 1 + e resolves.
// NaN stays NaN.
TRILLM_INLINE v8f exp_any(v8f x) {
  x = x > splat(89.0f) ? splat(89.0f) : x;
  const v8i big = x > splat(88.0f);
  const v8f e = exp_nonpositive(big ? x - splat(0.693147182f) : x);
  return big ? e * splat(2.0f) : e;
}

// ------------------------------------------------------------------------------------------
// Tensors: rows of n contiguous elements in a [outer, inner, n] layout with element strides (a
// [T, H] tensor is [1, T, H]; the q heads of a fused qkv buffer are [T, Hq, D] with the whole
// buffer's row stride).

template <typename T>
struct Rows {
  T* data;
  int64_t outer_stride, inner_stride, inner;

  T* at(int64_t outer, int64_t in) const { return data + outer * outer_stride + in * inner_stride; }
  T* row(int64_t r) const { return at(r / inner, r % inner); }
};

// From the Python wrappers: (data_ptr, outer stride, inner stride, inner count).
using RowsArg = std::tuple<uintptr_t, int64_t, int64_t, int64_t>;

template <typename T>
Rows<T> to_rows(const RowsArg& a) {
  const auto [data, outer_stride, inner_stride, inner] = a;
  if (inner <= 0) throw std::invalid_argument("a tensor's inner row count must be positive");
  return {reinterpret_cast<T*>(data), outer_stride, inner_stride, inner};
}

// ------------------------------------------------------------------------------------------
// The kernels: K<T>::rows(args, begin, end) handles rows begin .. end.

// 1 / sqrt(mean(x^2) + eps) over the n elements of a row (fp32 sum, as torch's mean).
TRILLM_INLINE float inv_rms(float sum_squares, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
}

// out = weight * dtype(x * rstd): HF casts the normalised value back before the weight multiply.
template <typename T>
TRILLM_INLINE void scale_row(T* out, const T* x, const T* weight, int64_t n, float rstd) {
  for_chunks(n, [&](int64_t i, int m) __attribute__((always_inline)) {
    store_n(out + i, load_n(weight + i, m) * round_to<T>(load_n(x + i, m) * splat(rstd)), m);
  });
}

template <typename T>
struct RmsNorm {
  struct Args {
    Rows<T> out;
    Rows<const T> x;
    const T* weight;
    int64_t hidden;
    float eps;
  };
  static TRILLM_INLINE void rows(const Args& a, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = a.x.row(r);
      const float sum = sum_chunks(a.hidden, [&](int64_t i, int m) __attribute__((always_inline)) {
        const v8f v = load_n(x + i, m);
        return v * v;
      });
      scale_row(a.out.row(r), x, a.weight, a.hidden, inv_rms(sum, a.hidden, a.eps));
    }
  }
};

template <typename T>
struct FusedAddRmsNorm {
  struct Args {
    Rows<T> x, residual;
    const T* weight;
    int64_t hidden;
    float eps;
  };
  // One pass writes the new residual and sums its squares; the second (over the row just
  // written, still in L1) writes the normalised row over x.
  static TRILLM_INLINE void rows(const Args& a, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = a.x.row(r);
      T* res = a.residual.row(r);
      const float sum = sum_chunks(a.hidden, [&](int64_t i, int m) __attribute__((always_inline)) {
        const v8f s = round_to<T>(load_n(x + i, m) + load_n(res + i, m));
        store_n(res + i, s, m);
        return s * s;
      });
      scale_row(x, res, a.weight, a.hidden, inv_rms(sum, a.hidden, a.eps));
    }
  }
};

template <typename T>
struct Rotary {
  struct Args {
    Rows<T> q, k;  // [T, Hq, D], [T, Hkv, D]
    const int64_t* positions;
    const float* cos_sin_cache;  // [max_pos, 2 * half]: cos, then sin
    int64_t cache_stride, half;
  };
  // x1 = x[:half], x2 = x[half:2 half] -> (x1 c - x2 s, x2 c + x1 s); the rest of the head stays.
  // In bf16, HF's rounding points: cos, sin and each product rounded to bf16, then the sum
  // (``q * cos + rotate_half(q) * sin`` with cos/sin cast to q's dtype); fp32: no rounding.
  static TRILLM_INLINE void rotate_heads(const Rows<T>& t, int64_t token, const float* cos,
                                         const float* sin, int64_t half) {
    for (int64_t h = 0; h < t.inner; ++h) {
      T* x = t.at(token, h);
      for_chunks(half, [&](int64_t i, int m) __attribute__((always_inline)) {
        const v8f x1 = load_n(x + i, m), x2 = load_n(x + half + i, m);
        const v8f c = round_to<T>(load_n(cos + i, m)), s = round_to<T>(load_n(sin + i, m));
        store_n(x + i, round_to<T>(x1 * c) - round_to<T>(x2 * s), m);
        store_n(x + half + i, round_to<T>(x2 * c) + round_to<T>(x1 * s), m);
      });
    }
  }
  static TRILLM_INLINE void rows(const Args& a, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = a.cos_sin_cache + a.positions[t] * a.cache_stride;
      rotate_heads(a.q, t, cos, cos + a.half, a.half);
      rotate_heads(a.k, t, cos, cos + a.half, a.half);
    }
  }
};

template <typename T>
struct SiluAndMul {
  struct Args {
    Rows<T> out;
    Rows<const T> gate_up;
    int64_t width;  // of out; gate_up rows are [gate | up], 2 * width
  };
  // silu(g) = g / (1 + exp(-g)) as torch computes it, rounded to T before the multiply (the
  // reference is F.silu(gate) * up: two ops, two roundings).
  static TRILLM_INLINE void rows(const Args& a, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = a.gate_up.row(r);
      const T* up = gate + a.width;
      T* out = a.out.row(r);
      for_chunks(a.width, [&](int64_t i, int m) __attribute__((always_inline)) {
        const v8f g = load_n(gate + i, m);
        const v8f silu = round_to<T>(g / (splat(1.0f) + exp_any(-g)));
        store_n(out + i, silu * load_n(up + i, m), m);
      });
    }
  }
#if defined(__x86_64__) && defined(__GNUC__)
  // The same results over 16 lanes (cpu_ops_avx512.h), where the CPU has AVX512F/BW/VL.
  static TRILLM_AVX512_OPS void rows_avx512(const Args& a, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = a.gate_up.row(r);
      trillm_cpu_ops_avx512::silu_and_mul_row(a.out.row(r), gate, gate + a.width, a.width);
    }
  }
#endif
};

// K/V rows of this step into their cache slots: token t's heads (strided rows of k and v) go
// to slot slot_mapping[t] of [num_slots, heads, head_dim] caches; a negative slot is padding.
template <typename T>
struct CacheWrite {
  struct Args {
    Rows<const T> k, v;  // token t, head h: k.at(t, h)
    T* key_cache;
    T* value_cache;
    const int64_t* slots;
    int64_t heads, head_dim;
  };
  static TRILLM_INLINE void rows(const Args& a, int64_t begin, int64_t end) {
    const int64_t slot_elems = a.heads * a.head_dim;
    const size_t bytes = sizeof(T) * a.head_dim;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = a.slots[t];
      if (slot < 0) continue;
      T* kd = a.key_cache + slot * slot_elems;
      T* vd = a.value_cache + slot * slot_elems;
      for (int64_t h = 0; h < a.heads; ++h) {
        std::memcpy(kd + h * a.head_dim, a.k.at(t, h), bytes);
        std::memcpy(vd + h * a.head_dim, a.v.at(t, h), bytes);
      }
    }
  }
};

// ------------------------------------------------------------------------------------------
// Dispatch: a kernel's AVX-512 build where it has one and the CPU runs it, else an AVX2/FMA
// build of each kernel when the CPU has it, the generic one otherwise;
// rows inline for small inputs, in chunks on the thread pool for large ones.

template <typename K>
using RowsFn = void (*)(const typename K::Args&, int64_t, int64_t);

template <typename K>
void rows_generic(const typename K::Args& a, int64_t begin, int64_t end) {
  K::rows(a, begin, end);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename K>
__attribute__((target("avx2,fma"))) void rows_avx2(const typename K::Args& a, int64_t begin,
                                                   int64_t end) {
  K::rows(a, begin, end);
}
#endif

// Whether K has a 16-lane build (K::rows_avx512) besides its 8-lane one.
template <typename K, typename = void>
struct HasAvx512Rows : std::false_type {};
template <typename K>
struct HasAvx512Rows<K, std::void_t<decltype(&K::rows_avx512)>> : std::true_type {};

template <typename K>
RowsFn<K> select_kernel() {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (HasAvx512Rows<K>::value) {
    static const bool avx512 = trillm_cpu_ops_avx512::cpu_has_avx512_ops();
    if (avx512) return &K::rows_avx512;
  }
  static const bool avx2 = cpu_has_avx2();
  if (avx2) return &rows_avx2<K>;
#endif
  return &rows_generic<K>;
}

// Runs K over rows 0 .. num_rows (row_work: a row's cost in kMinParallelWork's units, for the
// choice between inline and the pool).
template <typename K>
void run(const typename K::Args& a, int64_t num_rows, int64_t row_work, int num_threads) {
  const RowsFn<K> kernel = select_kernel<K>();
  py::gil_scoped_release release;
  if (num_threads <= 1 || num_rows < 2 || num_rows * row_work < kMinParallelWork) {
    kernel(a, 0, num_rows);
    return;
  }
  const int64_t chunks = std::min<int64_t>(num_rows, kChunksPerThread * num_threads);
  const int64_t chunk_rows = (num_rows + chunks - 1) / chunks;
  const int items = static_cast<int>((num_rows + chunk_rows - 1) / chunk_rows);
  std::function<void(int)> item = [&](int i) {
    kernel(a, i * chunk_rows, std::min(num_rows, (i + 1) * chunk_rows));
  };
  pool_for(num_threads)->run(items, item);
}

template <typename T>
struct Tag {
  using type = T;
};

// Runs K<T> for the wrappers' dtype code (0 = float32, 1 = bfloat16) on make(Tag<T>{}), its
// arguments.
template <template <typename> class K, typename Make>
void run_dtype(int dtype, int64_t num_rows, int64_t row_work, int num_threads, Make&& make) {
  if (dtype == 0) {
    run<K<float>>(make(Tag<float>{}), num_rows, row_work, num_threads);
  } else if (dtype == 1) {
    run<K<Bf16>>(make(Tag<Bf16>{}), num_rows, row_work, num_threads);
  } else {
    throw std::invalid_argument("dtype must be float32 or bfloat16");
  }
}

void check_sizes(int64_t num_rows, int64_t n) {
  if (num_rows < 0 || n <= 0) throw std::invalid_argument("need num_rows >= 0 and a positive width");
}

// ------------------------------------------------------------------------------------------
// Entry points (argument order: outputs first, as torch's out= ops).

void rms_norm(const RowsArg& out, const RowsArg& x, uintptr_t weight, int64_t num_rows,
              int64_t hidden, float eps, int dtype, int num_threads) {
  check_sizes(num_rows, hidden);
  if (num_rows == 0) return;
  run_dtype<RmsNorm>(dtype, num_rows, hidden, num_threads, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return typename RmsNorm<T>::Args{to_rows<T>(out), to_rows<const T>(x),
                                     reinterpret_cast<const T*>(weight), hidden, eps};
  });
}

void fused_add_rms_norm(const RowsArg& x, const RowsArg& residual, uintptr_t weight,
                        int64_t num_rows, int64_t hidden, float eps, int dtype, int num_threads) {
  check_sizes(num_rows, hidden);
  if (num_rows == 0) return;
  run_dtype<FusedAddRmsNorm>(dtype, num_rows, hidden, num_threads, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return typename FusedAddRmsNorm<T>::Args{to_rows<T>(x), to_rows<T>(residual),
                                             reinterpret_cast<const T*>(weight), hidden, eps};
  });
}

// q: [T, Hq, D], k: [T, Hkv, D] given as (data, token stride, head stride, heads); positions:
// [T] int64; cos_sin_cache: [max_pos, rotary_dim] fp32 rows cache_stride apart.
void rotary(const RowsArg& q, const RowsArg& k, uintptr_t positions, uintptr_t cos_sin_cache,
            int64_t num_tokens, int64_t head_dim, int64_t rotary_dim, int64_t max_pos,
            int64_t cache_stride, int dtype, int num_threads) {
  check_sizes(num_tokens, head_dim);
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    throw std::invalid_argument("rotary_dim must be even, positive and <= head_dim");
  const int64_t* pos = reinterpret_cast<const int64_t*>(positions);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (pos[t] < 0 || pos[t] >= max_pos)
      throw std::invalid_argument("position " + std::to_string(pos[t]) +
                                  " is outside the cos/sin cache (max_pos " +
                                  std::to_string(max_pos) + ")");
  }
  if (num_tokens == 0) return;
  const int64_t pairs = (std::get<3>(q) + std::get<3>(k)) * rotary_dim / 2;  // ~1 unit each
  run_dtype<Rotary>(dtype, num_tokens, pairs, num_threads, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return typename Rotary<T>::Args{to_rows<T>(q), to_rows<T>(k), pos,
                                    reinterpret_cast<const float*>(cos_sin_cache), cache_stride,
                                    rotary_dim / 2};
  });
}

void silu_and_mul(const RowsArg& out, const RowsArg& gate_up, int64_t num_rows, int64_t width,
                  int dtype, int num_threads) {
  check_sizes(num_rows, width);
  if (num_rows == 0) return;
  // exp and a division per element: ~5 units each
  run_dtype<SiluAndMul>(dtype, num_rows, 5 * width, num_threads, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return typename SiluAndMul<T>::Args{to_rows<T>(out), to_rows<const T>(gate_up), width};
  });
}

TRILLM_INLINE float scalar(float x) { return x; }
TRILLM_INLINE float scalar(Bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// An fp8 e4m3 cache (--kv-cache-dtype fp8): each value stored as e4m3 of x / 1.0 (the scale),
// rounded to nearest even, saturating at +-448 (torch's clamp-then-cast).
template <typename T>
void write_fp8(const Rows<const T>& k, const Rows<const T>& v, Fp8* key_cache, Fp8* value_cache,
               const int64_t* slots, int64_t num_tokens, int64_t heads, int64_t head_dim,
               int num_threads) {
  const int64_t slot_elems = heads * head_dim;
  const int chunks = num_tokens * slot_elems < (1 << 16)
                         ? 1
                         : static_cast<int>(std::min<int64_t>(num_tokens, 4 * num_threads));
  run_items(num_threads, chunks, [&](int c) {
    const int64_t t0 = num_tokens * c / chunks, t1 = num_tokens * (c + 1) / chunks;
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] < 0) continue;
      Fp8* kd = key_cache + slots[t] * slot_elems;
      Fp8* vd = value_cache + slots[t] * slot_elems;
      for (int64_t h = 0; h < heads; ++h) {
        const T* ks = k.at(t, h);
        const T* vs = v.at(t, h);
        for (int64_t d = 0; d < head_dim; ++d) {
          store(kd + h * head_dim + d, scalar(ks[d]));
          store(vd + h * head_dim + d, scalar(vs[d]));
        }
      }
    }
  });
}

// k, v: [T, heads, head_dim] as rows; key_cache, value_cache: [num_slots, heads, head_dim]
// contiguous, of k's dtype, or fp8 e4m3 when cache_fp8; slot_mapping: [T] int64.
void reshape_and_cache(const RowsArg& k, const RowsArg& v, uintptr_t key_cache,
                       uintptr_t value_cache, uintptr_t slot_mapping, int64_t num_tokens,
                       int64_t head_dim, int64_t num_slots, int dtype, int num_threads,
                       bool cache_fp8) {
  check_sizes(num_tokens, head_dim);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slot_mapping);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] >= num_slots)
      throw std::invalid_argument("slot " + std::to_string(slots[t]) +
                                  " is outside the cache (" + std::to_string(num_slots) +
                                  " slots)");
  }
  if (num_tokens == 0) return;
  const int64_t heads = std::get<3>(k);
  if (cache_fp8) {
    Fp8* kc = reinterpret_cast<Fp8*>(key_cache);
    Fp8* vc = reinterpret_cast<Fp8*>(value_cache);
    if (dtype == 0)
      write_fp8(to_rows<const float>(k), to_rows<const float>(v), kc, vc, slots, num_tokens, heads,
                head_dim, num_threads);
    else if (dtype == 1)
      write_fp8(to_rows<const Bf16>(k), to_rows<const Bf16>(v), kc, vc, slots, num_tokens, heads,
                head_dim, num_threads);
    else
      throw std::invalid_argument("dtype must be float32 or bfloat16");
    return;
  }
  // Two copies of heads x head_dim elements a token: ~1 unit a pair of elements.
  run_dtype<CacheWrite>(dtype, num_tokens, heads * head_dim, num_threads, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return typename CacheWrite<T>::Args{to_rows<const T>(k), to_rows<const T>(v),
                                        reinterpret_cast<T*>(key_cache),
                                        reinterpret_cast<T*>(value_cache), slots, heads,
                                        head_dim};
  });
}

}  // namespace

void register_cpu_ops(py::module_& m) {
  m.doc() =
      "Fused elementwise CPU ops of the Llama forward: RMSNorm, rotary, silu * mul, K/V cache "
      "writes.";
  trillm_cpu::def_kernel(m, "rms_norm", &rms_norm, py::arg("out"), py::arg("x"), py::arg("weight"),
        py::arg("num_rows"), py::arg("hidden"), py::arg("eps"), py::arg("dtype"),
        py::arg("num_threads"));
  trillm_cpu::def_kernel(m, "fused_add_rms_norm", &fused_add_rms_norm, py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("num_rows"), py::arg("hidden"), py::arg("eps"),
        py::arg("dtype"), py::arg("num_threads"));
  trillm_cpu::def_kernel(m, "rotary", &rotary, py::arg("q"), py::arg("k"), py::arg("positions"),
        py::arg("cos_sin_cache"), py::arg("num_tokens"), py::arg("head_dim"),
        py::arg("rotary_dim"), py::arg("max_pos"), py::arg("cache_stride"), py::arg("dtype"),
        py::arg("num_threads"));
  trillm_cpu::def_kernel(m, "silu_and_mul", &silu_and_mul, py::arg("out"), py::arg("gate_up"), py::arg("num_rows"),
        py::arg("width"), py::arg("dtype"), py::arg("num_threads"));
  trillm_cpu::def_kernel(m, "reshape_and_cache", &reshape_and_cache, py::arg("k"), py::arg("v"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("num_tokens"), py::arg("head_dim"), py::arg("num_slots"), py::arg("dtype"),
        py::arg("num_threads"), py::arg("cache_fp8") = false);
}
