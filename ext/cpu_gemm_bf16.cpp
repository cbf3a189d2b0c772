// bf16 GEMM for the CPU linear layers of a `--dtype bfloat16` model: y[M, N] = x[M, K] . W[N, K]^T
// (+ bias), W bf16 and packed once, products summed in fp32 by AVX-512 BF16's vdpbf16ps.
//
// Why: torch's bf16 F.linear at decode row counts is slower than trillm's fp32 packed GEMM, and
// the weights read per step are half the bytes. vdpbf16ps does 32 bf16 products a zmm, summed
// into 16 fp32 lanes in pairs: twice the multiply rate of an fp32 FMA of the same width.
//
// Packed layout: N is cut into panels of 64 output columns (the last one zero-padded); panel p
// holds, for each pair of k (2j, 2j+1), the 64 columns' two values side by side: [K/2][64][2]
// bf16 (K odd: a zero is added), 128 bytes a k-pair, read sequentially by the kernel as four
// zmm. A row of x is read as 32-bit bf16 pairs, each broadcast against those four vectors.
// x may be fp32 (converted once per call to bf16, round to nearest even, like torch's cast) or
// bf16; y fp32 or bf16 (rounded from the fp32 sums, like torch's bf16 matmul output).
// Work items as in cpu_gemm.cpp: (block of rows, run of panels) on the shared pool.
// The summation order over k is fixed per output, so results do not depend on the thread count.
// `supported()` is false on CPUs without AVX512F/BW/VL + AVX512_BF16 (checked at run time with
// __builtin_cpu_supports): callers then keep torch's F.linear.
#include <pybind11/pybind11.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_bf16_tiles.h"
#include "cpu_common.h"
#include "cpu_program.h"

namespace py = pybind11;

namespace {

constexpr int kCols = kPanelCols;
constexpr int kPairStride = kCols * 2;  // bf16 values per k-pair of a panel

// AMX tiles multiply bf16 several times faster than vdpbf16ps once there are enough rows to
// fill them; this kernel does not use them, but the caller may leave those calls to torch.
bool cpu_has_amx_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-bf16");
#else
  return false;
#endif
}

// The register-block kernel of run_gemm (cpu_bf16_tiles.h).
struct Bf16Kernel {
  using Weight = uint16_t;
  static constexpr int kRows = 6;  // rows of x per register block: 6 x 4 accumulators
  static constexpr bool kRowPairs = true;  // has row_pair: one row over two panels at once

  template <int R>
  TRILLM_BF16_TARGET static void block(const uint16_t* x, int64_t ldx, const uint16_t* panel,
                                       int K, const float* scale, const float* bias, void* y,
                                       int64_t ldy, bool y_bf16, int cols);
  TRILLM_BF16_TARGET static void row_pair(const uint16_t* x, const uint16_t* const* panels, int K,
                                          const float* const* bias, void* const* y, bool y_bf16,
                                          const int* cols);
};

// One row (a decode step's GEMM) over two panels at once: the same products and fp32 sums as
// block<1> on each panel (bit for bit), but two streams of weights in flight instead of one: a
// single panel's stream leaves memory idle between its loads (one thread: 9.2 -> 11.0 GB/s in
// a standalone test of the loop, 177 MB of panels).
TRILLM_BF16_TARGET inline void Bf16Kernel::row_pair(const uint16_t* x,
                                                    const uint16_t* const* panels, int K,
                                                    const float* const* bias, void* const* y,
                                                    bool y_bf16, const int* cols) {
  __m512 acc[2][4];
  for (int p = 0; p < 2; ++p)
    for (int v = 0; v < 4; ++v) acc[p][v] = _mm512_setzero_ps();
  const int full = K / 2;
  for (int j = 0; j < full; ++j) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * j, 4);
    const __m512bh xj = (__m512bh)_mm512_set1_epi32(pair);
    for (int p = 0; p < 2; ++p) {
      const uint16_t* w = panels[p] + static_cast<int64_t>(j) * kPairStride;
      for (int line = 0; line < 4; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + 8 * kPairStride + 32 * line), _MM_HINT_T0);
      for (int v = 0; v < 4; ++v)
        acc[p][v] = _mm512_dpbf16_ps(acc[p][v], xj, (__m512bh)_mm512_loadu_si512(w + 32 * v));
    }
  }
  if (K & 1) {  // the last k alone: its pair's high half is zero in x and in the panel
    const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[K - 1]));
    for (int p = 0; p < 2; ++p) {
      const uint16_t* w = panels[p] + static_cast<int64_t>(full) * kPairStride;
      for (int v = 0; v < 4; ++v)
        acc[p][v] = _mm512_dpbf16_ps(acc[p][v], xk, (__m512bh)_mm512_loadu_si512(w + 32 * v));
    }
  }
  for (int p = 0; p < 2; ++p) {
    if (bias[p] != nullptr) {
      alignas(64) float b[kCols] = {};
      for (int c = 0; c < cols[p]; ++c) b[c] = bias[p][c];
      for (int v = 0; v < 4; ++v) acc[p][v] = _mm512_add_ps(acc[p][v], _mm512_load_ps(b + 16 * v));
    }
    store_row(acc[p], y[p], y_bf16, cols[p]);
  }
}

// y[0..R, 0..cols) = x[0..R, :] . panel (+ bias); no scale (always null here).
template <int R>
TRILLM_BF16_TARGET inline __attribute__((always_inline)) void Bf16Kernel::block(
    const uint16_t* x, int64_t ldx, const uint16_t* panel, int K, const float* /*scale*/,
    const float* bias, void* y, int64_t ldy, bool y_bf16, int cols) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  const int full = K / 2;  // pairs with both elements in the row
  for (int j = 0; j < full; ++j) {
    const uint16_t* w = panel + static_cast<int64_t>(j) * kPairStride;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    // 8 pairs (2 KiB) ahead, its four lines: the panel streams in from memory on the first
    // row block.
    for (int line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(w + 8 * kPairStride + 32 * line), _MM_HINT_T0);
    for (int i = 0; i < R; ++i) {
      int32_t p;
      std::memcpy(&p, x + i * ldx + 2 * j, 4);
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(p);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xi, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xi, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xi, w2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xi, w3);
    }
  }
  if (K & 1) {  // the last k alone: its pair's high half is zero in x and in the panel
    const uint16_t* w = panel + static_cast<int64_t>(full) * kPairStride;
    __m512bh wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    for (int i = 0; i < R; ++i) {
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[i * ldx + K - 1]));
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xi, wv[v]);
    }
  }
  if (bias != nullptr) {
    alignas(64) float b[kCols] = {};
    for (int c = 0; c < cols; ++c) b[c] = bias[c];
    for (int v = 0; v < 4; ++v) {
      const __m512 bv = _mm512_load_ps(b + 16 * v);
      for (int i = 0; i < R; ++i) acc[i][v] = _mm512_add_ps(acc[i][v], bv);
    }
  }
  const int64_t elem = y_bf16 ? 2 : 4;
  for (int i = 0; i < R; ++i)
    store_row(acc[i], static_cast<char*>(y) + i * ldy * elem, y_bf16, cols);
}

// bf16 values in the packed copy of an [N, K] weight.
int64_t packed_size(int N, int K) {
  return static_cast<int64_t>(num_panels(N)) * ((K + 1) / 2) * kPairStride;
}

// W [N, K] bf16 (row stride ldw) -> packed [packed_size(N, K)] bf16. Plain C++: runs anywhere.
void pack(uintptr_t weight, int N, int K, int64_t ldw, uintptr_t packed) {
  if (N <= 0 || K <= 0) throw std::invalid_argument("N and K must be positive");
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight);
  uint16_t* out = reinterpret_cast<uint16_t*>(packed);
  py::gil_scoped_release release;
  const int pairs = (K + 1) / 2;
  for (int p = 0; p < num_panels(N); ++p) {
    uint16_t* panel = out + static_cast<int64_t>(p) * pairs * kPairStride;
    for (int c = 0; c < kCols; ++c) {
      const int n = p * kCols + c;
      for (int k = 0; k < 2 * pairs; ++k)
        panel[(k / 2) * kPairStride + 2 * c + (k & 1)] =
            n < N && k < K ? w[static_cast<int64_t>(n) * ldw + k] : 0;
    }
  }
}

void linear(uintptr_t x, bool x_bf16, int M, int K, int64_t ldx, uintptr_t packed, int N,
            uintptr_t bias, uintptr_t y, bool y_bf16, int64_t ldy, int num_threads) {
  static const bool ok = cpu_has_avx512bf16();
  if (!ok) throw std::runtime_error("cpu_gemm_bf16 needs a CPU with AVX512-BF16");
  if (M < 0 || N <= 0 || K <= 0) throw std::invalid_argument("bad GEMM shape");
  if (M == 0) return;
  const PanelGemm<uint16_t> g{nullptr, ldx, reinterpret_cast<const uint16_t*>(packed), nullptr,
                              reinterpret_cast<const float*>(bias), reinterpret_cast<void*>(y),
                              ldy, M, N, K, y_bf16};
  py::gil_scoped_release release;
  run_gemm<Bf16Kernel>(g, reinterpret_cast<const void*>(x), x_bf16, num_threads);
}

}  // namespace

void register_cpu_gemm_bf16(py::module_& m) {
  m.doc() = "bf16 GEMM (AVX512-BF16, fp32 sums) with weights packed once, for the CPU linears.";
  m.attr("PANEL") = kCols;
  m.def("supported", &cpu_has_avx512bf16, "Whether this CPU has AVX512F/BW/VL and AVX512-BF16.");
  m.def("amx_bf16", &cpu_has_amx_bf16,
        "Whether this CPU has AMX-BF16 (torch's oneDNN then multiplies bf16 faster at many rows).");
  m.def("num_panels", &num_panels, py::arg("n"));
  m.def("packed_size", &packed_size, py::arg("n"), py::arg("k"));
  m.def("pack", &pack, py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("ldw"),
        py::arg("packed"));
  trillm_cpu::def_kernel(m, "linear", &linear, py::arg("x"), py::arg("x_bf16"), py::arg("m"), py::arg("k"),
        py::arg("ldx"), py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("y"),
        py::arg("y_bf16"), py::arg("ldy"), py::arg("num_threads"));
}
