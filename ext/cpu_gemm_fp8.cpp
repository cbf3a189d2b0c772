// fp8 weight-only GEMM for `--quantization fp8` on CPU: y[M, N] = (x[M, K] . Q[N, K]^T) * s[N]
// (+ bias), Q one fp8 e4m3 byte a weight with a scale per output channel, products summed in
// fp32 by AVX-512 BF16's vdpbf16ps.
//
// Why: a batch-1 decode step reads every weight once and is bound by memory bandwidth; one byte
// a weight is half of bf16's two and a quarter of fp32's four. Every e4m3 value is exactly a
// bf16 value (3 mantissa bits of 7, exponents 2^-9..2^8 inside bf16's range), so the bytes are
// widened to bf16 in registers and multiplied by the same instruction as the bf16 GEMM: the
// only rounding beyond the quantization itself is x's to bf16 (fp32 activations) and y's.
//
// e4m3 -> bf16, 32 values a zmm (sign s, exponent e of 4 bits with bias 7, mantissa m of 3):
// a normal value (e > 0) is bf16 bits s<<15 | (e + 120)<<7 | m<<4, i.e. (byte & 0x7f) << 4
// plus 120 << 7; a subnormal one (e = 0) is m * 2^-9, looked up in an 8-entry table (vpermw).
// Bytes 0x7f / 0xff (e4m3's NaN) are never written by the quantizer and read as +-480.
//
// Packed layout: as the bf16 GEMM's, with bytes: N in panels of 64 output columns (the last
// zero-padded), panel p holding for each k-pair (2j, 2j+1) the 64 columns' two bytes side by
// side, [K/2][64][2] (K odd: a zero byte added), 128 bytes a k-pair, read as four 32-byte loads
// that widen to four zmm of bf16 pairs. The packing is done in torch (kernels/linear_cpu.py).
// A row of x is read as 32-bit bf16 pairs, each broadcast against those four vectors; the scale
// multiplies the fp32 sums once per output. Work items and thread split: run_gemm
// (cpu_bf16_tiles.h); the summation order over k is fixed per output (results do not depend
// on the thread count).
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

constexpr int kPairBytes = kPanelCols * 2;  // bytes per k-pair of a panel

// bf16 bits of the e4m3 subnormals m * 2^-9, m = 0..7 (exact: m has at most 3 bits); the
// rest of the 32 entries are never selected.
alignas(64) const uint16_t kSubnormals[32] = {0x0000, 0x3b00, 0x3b80, 0x3bc0,
                                               0x3c00, 0x3c20, 0x3c40, 0x3c60};

// 32 e4m3 bytes -> 32 bf16 values (exact).
TRILLM_BF16_TARGET inline __attribute__((always_inline)) __m512bh widen(const uint8_t* p,
                                                                       __m512i subnormals) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
  __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  bits = _mm512_mask_permutexvar_epi16(bits, sub, mag, subnormals);
  // bits | (b << 8 & 0x8000): the sign bit moved to bf16's
  bits = _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(b, 8), _mm512_set1_epi16(-32768),
                                   0xf8);
  return (__m512bh)bits;
}

// The register-block kernel of run_gemm (cpu_bf16_tiles.h).
struct Fp8Kernel {
  using Weight = uint8_t;
  static constexpr int kRows = 4;  // rows of x per register block (4 x 4 accumulators)
  static constexpr bool kRowPairs = false;  // no one-row two-panel block

  template <int R>
  TRILLM_BF16_TARGET static void block(const uint16_t* x, int64_t ldx, const uint8_t* panel,
                                       int K, const float* scale, const float* bias, void* y,
                                       int64_t ldy, bool y_bf16, int cols);
};

// y[0..R, 0..cols) = (x[0..R, :] . panel) * scale (+ bias).
template <int R>
TRILLM_BF16_TARGET inline __attribute__((always_inline)) void Fp8Kernel::block(
    const uint16_t* x, int64_t ldx, const uint8_t* panel, int K, const float* scale,
    const float* bias, void* y, int64_t ldy, bool y_bf16, int cols) {
  const __m512i subnormals = _mm512_load_si512(kSubnormals);
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  const int full = K / 2;  // pairs with both elements in the row
  for (int j = 0; j < full; ++j) {
    const uint8_t* w = panel + static_cast<int64_t>(j) * kPairBytes;
    // 16 pairs (2 KiB) ahead, its two lines: the panel streams in from memory.
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kPairBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kPairBytes + 64), _MM_HINT_T0);
    __m512bh wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = widen(w + 32 * v, subnormals);
    for (int i = 0; i < R; ++i) {
      int32_t p;
      std::memcpy(&p, x + i * ldx + 2 * j, 4);
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(p);
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xi, wv[v]);
    }
  }
  if (K & 1) {  // the last k alone: its pair's high half is zero in x and in the panel
    const uint8_t* w = panel + static_cast<int64_t>(full) * kPairBytes;
    __m512bh wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = widen(w + 32 * v, subnormals);
    for (int i = 0; i < R; ++i) {
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[i * ldx + K - 1]));
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xi, wv[v]);
    }
  }
  for (int v = 0; v < 4; ++v) {
    const int left = cols - 16 * v;
    const __mmask16 mask =
        left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
    const __m512 sv = _mm512_maskz_loadu_ps(mask, scale + 16 * v);
    if (bias != nullptr) {
      const __m512 bv = _mm512_maskz_loadu_ps(mask, bias + 16 * v);
      for (int i = 0; i < R; ++i) acc[i][v] = _mm512_fmadd_ps(acc[i][v], sv, bv);
    } else {
      for (int i = 0; i < R; ++i) acc[i][v] = _mm512_mul_ps(acc[i][v], sv);
    }
  }
  const int64_t elem = y_bf16 ? 2 : 4;
  for (int i = 0; i < R; ++i)
    store_row(acc[i], static_cast<char*>(y) + i * ldy * elem, y_bf16, cols);
}

void linear(uintptr_t x, bool x_bf16, int M, int K, int64_t ldx, uintptr_t packed, int N,
            uintptr_t scale, uintptr_t bias, uintptr_t y, bool y_bf16, int64_t ldy,
            int num_threads) {
  static const bool ok = cpu_has_avx512bf16();
  if (!ok) throw std::runtime_error("cpu_gemm_fp8 needs a CPU with AVX512-BF16");
  if (M < 0 || N <= 0 || K <= 0) throw std::invalid_argument("bad GEMM shape");
  if (scale == 0) throw std::invalid_argument("the per-channel scales are required");
  if (M == 0) return;
  const PanelGemm<uint8_t> g{nullptr, ldx, reinterpret_cast<const uint8_t*>(packed),
                             reinterpret_cast<const float*>(scale),
                             reinterpret_cast<const float*>(bias), reinterpret_cast<void*>(y),
                             ldy, M, N, K, y_bf16};
  py::gil_scoped_release release;
  run_gemm<Fp8Kernel>(g, reinterpret_cast<const void*>(x), x_bf16, num_threads);
}

}  // namespace

void register_cpu_gemm_fp8(py::module_& m) {
  m.doc() = "fp8 e4m3 weight-only GEMM (AVX512-BF16, fp32 sums, a scale per output channel).";
  m.attr("PANEL") = kPanelCols;
  m.def("supported", &cpu_has_avx512bf16, "Whether this CPU has AVX512F/BW/VL and AVX512-BF16.");
  m.def("num_panels", &num_panels, py::arg("n"));
  trillm_cpu::def_kernel(m, "linear", &linear, py::arg("x"), py::arg("x_bf16"), py::arg("m"), py::arg("k"),
        py::arg("ldx"), py::arg("packed"), py::arg("n"), py::arg("scale"), py::arg("bias"),
        py::arg("y"), py::arg("y_bf16"), py::arg("ldy"), py::arg("num_threads"));
}
