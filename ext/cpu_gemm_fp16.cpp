// fp16 GEMM for the CPU linear layers of a `--dtype float16` model: y[M, N] = x[M, K] . W[N, K]^T
// (+ bias), x, W and y fp16, W packed once, products summed in fp32.
//
// Why: torch's fp16 F.linear on a CPU without AVX512-FP16 runs a generic kernel, 3-10x slower
// than its fp32 GEMM from 16 rows up; converting the weights to fp32 would double their memory
// (and the bytes each decode step reads). Here the weights stay fp16 and F16C's vcvtph2ps widens
// them in registers: each product of two fp16 values is exact in fp32, summed by FMA in fp32, the
// bias (fp32, exact from fp16) added last, and the sum rounded to fp16 once (round to nearest
// even), as torch's fp16 matmul rounds its fp32 sums: the same values up to summation order.
//
// Packed layout (cpu_gemm.cpp's, in fp16): N cut into panels of 16 output columns (the last one
// zero-padded), panel p = W[16p .. 16p+15, k] for k = 0 .. K-1 as [K][16]. A work item converts
// its block of x rows to fp32 once (exact), then walks the panels of its run in register blocks
// of 6 rows x 16 columns. Work items, pool and GIL as in cpu_gemm.cpp; the summation order over k
// is fixed per output, so results do not depend on the thread count or the rows in the call.
// One kernel (AVX2 + FMA + F16C), used on AVX-512 and AMX hosts too, which have those; checked
// at run time (`supported()`), else callers keep torch's F.linear.
//
// The same kernel, templated over the 16-bit format, serves bf16 (`linear_bf16`) on AVX2 hosts
// without AVX512-BF16 (torch's bf16 F.linear there runs ~7x slower than its fp32 GEMM): bf16
// widens to fp32 exactly by a 16-bit shift, and the fp32 sums are rounded to bf16 once (round to
// nearest even, NaN kept quiet), as torch's bf16 matmul rounds its fp32 sums.
#include <pybind11/pybind11.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_common.h"
#include "cpu_program.h"

namespace py = pybind11;

namespace {

constexpr int kPanel = 16;      // output columns per panel: two 8-lane vectors
constexpr int kRows = 6;        // rows of x per register block: 6 x 2 accumulators
constexpr int kRowBlock = 192;  // rows of x per work item (as fp32: 192 x K floats in L2)
constexpr int kWidenRows = 12;   // from this many rows a panel is widened to fp32 once
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

bool cpu_has_f16c() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

struct Gemm {
  const uint16_t* x;  // fp16 bits
  int64_t ldx;
  const uint16_t* packed;
  const float* bias;  // null: none
  uint16_t* y;        // fp16 bits
  int64_t ldy;
  int M, N, K;
};

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// The two 16-bit formats: 8 values widened to fp32 (exact), one value, and 8 fp32 sums rounded.
struct Fp16Format {
  static inline __attribute__((always_inline)) __m256 widen8(const uint16_t* v) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  }
  static float widen1(uint16_t v) { return _cvtsh_ss(v); }
  static inline __attribute__((always_inline)) __m128i narrow8(__m256 v) {
    return _mm256_cvtps_ph(v, kRound);
  }
};

struct Bf16Format {
  static inline __attribute__((always_inline)) __m256 widen8(const uint16_t* v) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static float widen1(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  // Round to nearest even: add 0x7FFF plus the kept part's lowest bit, keep the high half; a NaN
  // becomes the quiet NaN 0x7FC0 (torch's c10::BFloat16 conversion does the same).
  static inline __attribute__((always_inline)) __m128i narrow8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
    __m256i high = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    high = _mm256_blendv_epi8(high, _mm256_set1_epi32(0x7FC0), nan);
    // 32 -> 16 bits (every value fits): packus works within 128-bit lanes, the permute
    // puts the two lanes' 4 values side by side.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
};

// rows x K 16-bit values (row stride ldx) -> fp32 [rows][K], exact.
template <typename F>
void widen_rows(const uint16_t* x, int64_t ldx, int rows, int K, float* out) {
  for (int i = 0; i < rows; ++i) {
    const uint16_t* src = x + i * ldx;
    float* dst = out + static_cast<int64_t>(i) * K;
    int k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, F::widen8(src + k));
    for (; k < K; ++k) dst[k] = F::widen1(src[k]);
  }
}

// A panel's 8 columns at k as fp32: widened from the 16-bit format, or already widened.
template <typename F>
inline __attribute__((always_inline)) __m256 load_cols8(const uint16_t* w) {
  return F::widen8(w);
}
template <typename F>
inline __attribute__((always_inline)) __m256 load_cols8(const float* w) {
  return _mm256_loadu_ps(w);
}

// y[0..R, 0..cols) = x[0..R, :] . panel (+ bias), rounded to F; x fp32 rows of stride K; the
// panel in F, or widened to fp32 (W: uint16_t or float).
template <typename F, int R, typename W>
inline __attribute__((always_inline)) void block(const float* x, const W* panel, int K,
                                                 const float* bias, uint16_t* y, int64_t ldy,
                                                 int cols) {
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  // 1 KiB ahead: the panel streams in from memory on the first row block.
  constexpr int kAhead = static_cast<int>(1024 / (kPanel * sizeof(W)));
  for (int k = 0; k < K; ++k) {
    const __m256 w0 = load_cols8<F>(panel + k * kPanel);
    const __m256 w1 = load_cols8<F>(panel + k * kPanel + 8);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel), _MM_HINT_T0);
    for (int i = 0; i < R; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + static_cast<int64_t>(i) * K + k);
      acc[i][0] = _mm256_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xi, w1, acc[i][1]);
    }
  }
  if (bias != nullptr) {
    alignas(32) float b[kPanel] = {};
    std::memcpy(b, bias, sizeof(float) * cols);
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm256_add_ps(acc[i][0], b0);
      acc[i][1] = _mm256_add_ps(acc[i][1], b1);
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m128i lo = F::narrow8(acc[i][0]);
    const __m128i hi = F::narrow8(acc[i][1]);
    if (cols == kPanel) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i * ldy), lo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i * ldy + 8), hi);
    } else {
      alignas(32) uint16_t row[kPanel];
      _mm_store_si128(reinterpret_cast<__m128i*>(row), lo);
      _mm_store_si128(reinterpret_cast<__m128i*>(row + 8), hi);
      std::memcpy(y + i * ldy, row, sizeof(uint16_t) * cols);
    }
  }
}

// Every row of xf (g.M rows, widened to fp32) against one panel (in F, or widened: W).
template <typename F, typename W>
void rows(const Gemm& g, const float* xf, const W* panel, const float* bias, int col, int cols) {
  int m = 0;
  for (; m + kRows <= g.M; m += kRows)
    block<F, kRows>(xf + static_cast<int64_t>(m) * g.K, panel, g.K, bias, g.y + m * g.ldy + col,
                 g.ldy, cols);
  const float* x = xf + static_cast<int64_t>(m) * g.K;
  uint16_t* y = g.y + m * g.ldy + col;
  switch (g.M - m) {
    case 1: block<F, 1>(x, panel, g.K, bias, y, g.ldy, cols); break;
    case 2: block<F, 2>(x, panel, g.K, bias, y, g.ldy, cols); break;
    case 3: block<F, 3>(x, panel, g.K, bias, y, g.ldy, cols); break;
    case 4: block<F, 4>(x, panel, g.K, bias, y, g.ldy, cols); break;
    case 5: block<F, 5>(x, panel, g.K, bias, y, g.ldy, cols); break;
    default: break;
  }
}

// Panels [first, last) for the g.M rows of xf. Past kWidenRows rows a panel is widened to fp32
// once (K x 64 bytes, in L1/L2) instead of once per register block of rows: the conversions
// share the FMA ports.
template <typename F>
void panels(const Gemm& g, const float* xf, int first, int last) {
  std::vector<float> wide(g.M >= kWidenRows ? static_cast<size_t>(g.K) * kPanel : 0);
  for (int p = first; p < last; ++p) {
    const uint16_t* panel = g.packed + static_cast<int64_t>(p) * g.K * kPanel;
    const int col = p * kPanel;
    const int cols = std::min(kPanel, g.N - col);
    const float* bias = g.bias == nullptr ? nullptr : g.bias + col;
    if (wide.empty()) {
      rows<F>(g, xf, panel, bias, col, cols);
    } else {
      widen_rows<F>(panel, 0, 1, g.K * kPanel, wide.data());
      rows<F>(g, xf, wide.data(), bias, col, cols);
    }
  }
}

#pragma GCC pop_options

int num_panels(int N) { return (N + kPanel - 1) / kPanel; }

// W [N, K] fp16 or bf16 (row stride ldw) -> packed [num_panels(N) * K * 16], the same format.
// Plain C++.
void pack(uintptr_t weight, int N, int K, int64_t ldw, uintptr_t packed) {
  if (N <= 0 || K <= 0) throw std::invalid_argument("N and K must be positive");
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight);
  uint16_t* out = reinterpret_cast<uint16_t*>(packed);
  py::gil_scoped_release release;
  for (int p = 0; p < num_panels(N); ++p) {
    uint16_t* panel = out + static_cast<int64_t>(p) * K * kPanel;
    for (int c = 0; c < kPanel; ++c) {
      const int n = p * kPanel + c;
      for (int k = 0; k < K; ++k)
        panel[static_cast<int64_t>(k) * kPanel + c] = n < N ? w[n * ldw + k] : 0;
    }
  }
}

template <typename F>
void linear(uintptr_t x, int M, int K, int64_t ldx, uintptr_t packed, int N, uintptr_t bias,
            uintptr_t y, int64_t ldy, int num_threads) {
  static const bool ok = cpu_has_f16c();
  if (!ok) throw std::runtime_error("cpu_gemm_fp16 needs a CPU with AVX2, FMA and F16C");
  if (M < 0 || N <= 0 || K <= 0) throw std::invalid_argument("bad GEMM shape");
  if (M == 0) return;
  const Gemm g{reinterpret_cast<const uint16_t*>(x), ldx,
               reinterpret_cast<const uint16_t*>(packed), reinterpret_cast<const float*>(bias),
               reinterpret_cast<uint16_t*>(y), ldy, M, N, K};
  const int total = num_panels(N);
  // Work items as cpu_gemm.cpp's: (block of rows, run of panels), row-block major, about four
  // runs per thread; under ~1 MFLOP the caller does it alone.
  const int threads = 2LL * M * N * K < 1000000 ? 1 : num_threads;
  const int row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int runs = threads <= 1 ? 1 : std::min(total, 4 * threads);
  auto item = [&](int i) {
    const int rb = i / runs, run = i % runs;
    Gemm part = g;
    const int row0 = rb * kRowBlock;
    part.M = std::min(kRowBlock, M - row0);
    part.y += row0 * ldy;
    // NOTE: each run widens its row block again: K conversions per row against N/runs * K
    // FMAs per row, a few percent at most.
    std::vector<float> xf(static_cast<size_t>(part.M) * K);
    widen_rows<F>(g.x + row0 * ldx, ldx, part.M, K, xf.data());
    panels<F>(part, xf.data(), static_cast<int>(static_cast<int64_t>(total) * run / runs),
           static_cast<int>(static_cast<int64_t>(total) * (run + 1) / runs));
  };
  py::gil_scoped_release release;
  run_items(threads, row_blocks * runs, item);
}

}  // namespace

void register_cpu_gemm_fp16(py::module_& m) {
  m.doc() = "fp16 GEMM (F16C widening, fp32 sums) with weights packed once, for the CPU linears.";
  m.attr("PANEL") = kPanel;
  m.def("supported", &cpu_has_f16c, "Whether this CPU has AVX2, FMA and F16C.");
  m.def("num_panels", &num_panels, py::arg("n"));
  m.def("pack", &pack, py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("ldw"),
        py::arg("packed"));
  trillm_cpu::def_kernel(m, "linear", &linear<Fp16Format>, py::arg("x"), py::arg("m"),
                         py::arg("k"), py::arg("ldx"), py::arg("packed"), py::arg("n"),
                         py::arg("bias"), py::arg("y"), py::arg("ldy"), py::arg("num_threads"));
  // bf16 x, packed W and y (W packed by `pack`: the layout does not depend on the format).
  trillm_cpu::def_kernel(m, "linear_bf16", &linear<Bf16Format>, py::arg("x"), py::arg("m"),
                         py::arg("k"), py::arg("ldx"), py::arg("packed"), py::arg("n"),
                         py::arg("bias"), py::arg("y"), py::arg("ldy"), py::arg("num_threads"));
}
