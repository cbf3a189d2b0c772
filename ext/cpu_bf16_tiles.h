// AVX-512 BF16 pieces shared by the bf16 and fp8 GEMMs (cpu_gemm_bf16.cpp, cpu_gemm_fp8.cpp):
// the target attribute, the CPU check, fp32 -> bf16 rows, storing a 64-column row of fp32 sums,
// and the driver over panels of packed weights (`run_gemm`), which each GEMM instantiates with
// its own register-block kernel.
// Anonymous namespace: a copy per source file (both are small and always inlined or local).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace {

// The AVX-512 code lives only in functions with this attribute (no pragma region): an inline
// std:: template instantiated inside such a region could be the copy the linker keeps for the
// generic code too.
#define TRILLM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kPanelCols = 64;  // output columns per packed panel: four 16-lane fp32 vectors
constexpr int kRowBlock = 192;  // rows of x per work item (bf16: 192 x K x 2 bytes in L2)

// cpu_has_avx512bf16() (cpu_common.h), checked at run time: the GEMMs refuse to run without it.

inline int num_panels(int N) { return (N + kPanelCols - 1) / kPanelCols; }

// Stores 64 fp32 sums (four vectors) as fp32 or bf16 (round to nearest even), the first
// `cols` of them.
TRILLM_BF16_TARGET inline __attribute__((always_inline)) void store_row(const __m512* acc,
                                                                       void* y, bool y_bf16,
                                                                       int cols) {
  if (y_bf16) {
    uint16_t* out = static_cast<uint16_t*>(y);
    for (int v = 0; v < 4; ++v) {
      const int left = cols - 16 * v;
      if (left <= 0) break;
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[v]);
      const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      _mm256_mask_storeu_epi16(out + 16 * v, mask, h);
    }
  } else {
    float* out = static_cast<float*>(y);
    for (int v = 0; v < 4; ++v) {
      const int left = cols - 16 * v;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      _mm512_mask_storeu_ps(out + 16 * v, mask, acc[v]);
    }
  }
}

// fp32 rows -> bf16 rows (round to nearest even; NaN stays NaN), n values.
TRILLM_BF16_TARGET inline void to_bf16(const float* in, uint16_t* out, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(mask, in + i);
    _mm256_mask_storeu_epi16(out + i, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// x [M, K] fp32 (row stride ldx) -> `out`, bf16 rows of even length (the pad is never read),
// split over the pool; -> the rows' stride.
inline int64_t rows_to_bf16(int threads, const float* x, int M, int K, int64_t ldx,
                            std::vector<uint16_t>& out) {
  const int64_t ld = K + (K & 1);
  out.resize(static_cast<size_t>(M) * ld);
  const int chunks = threads <= 1 ? 1 : std::min(M, 4 * threads);
  run_items(threads, chunks, [&](int c) {
    const int r0 = static_cast<int>(static_cast<int64_t>(M) * c / chunks);
    const int r1 = static_cast<int>(static_cast<int64_t>(M) * (c + 1) / chunks);
    for (int r = r0; r < r1; ++r) to_bf16(x + r * ldx, out.data() + r * ld, K);
  });
  return ld;
}

// One GEMM's operands: y[M, N] = (x[M, K] . W[N, K]^T) * scale (+ bias). W is packed in panels
// of 64 output columns, each [(K + 1) / 2][64][2] elements of type W (k-pairs side by side).
template <typename W>
struct PanelGemm {
  const uint16_t* x;  // bf16 rows, stride ldx (elements)
  int64_t ldx;
  const W* packed;
  const float* scale;  // [N]; null: none
  const float* bias;   // [N]; null: none
  void* y;             // float or bf16 rows, stride ldy (elements)
  int64_t ldy;
  int M, N, K;
  bool y_bf16;
};

// The last M % kRows rows of a panel: Kernel::block<R> for R = rows (< kRows).
template <class Kernel, int R>
TRILLM_BF16_TARGET inline __attribute__((always_inline)) void tail_block(
    int rows, const uint16_t* x, int64_t ldx, const typename Kernel::Weight* panel, int K,
    const float* scale, const float* bias, void* y, int64_t ldy, bool y_bf16, int cols) {
  if constexpr (R > 0) {
    if (rows == R)
      Kernel::template block<R>(x, ldx, panel, K, scale, bias, y, ldy, y_bf16, cols);
    else
      tail_block<Kernel, R - 1>(rows, x, ldx, panel, K, scale, bias, y, ldy, y_bf16, cols);
  }
}

// Panels [first, last) of `g`, all its rows, register block by register block. Kernel: a
// class with `using Weight` (W), `static constexpr int kRows` (rows of its full register block),
// `static constexpr bool kRowPairs` (true: it has `row_pair(x, panels[2], K, bias[2], y[2],
// y_bf16, cols[2])`, one row over two panels, used when g has one row and no scale) and
// `template <int R> static void block(x, ldx, panel, K, scale, bias, y, ldy, y_bf16, cols)`
// computing y[0..R, 0..cols) of one panel (scale and bias at the panel's first column).
template <class Kernel>
TRILLM_BF16_TARGET void run_panels(const PanelGemm<typename Kernel::Weight>& g, int first,
                                   int last) {
  constexpr int kRows = Kernel::kRows;
  const int64_t elem = g.y_bf16 ? 2 : 4;
  const int64_t panel_size = static_cast<int64_t>((g.K + 1) / 2) * kPanelCols * 2;
  if constexpr (Kernel::kRowPairs) {
    if (g.M == 1 && g.scale == nullptr) {  // one row: two panels' weights stream at once
      for (; first + 2 <= last; first += 2) {
        const typename Kernel::Weight* panels[2];
        const float* bias[2];
        void* y[2];
        int cols[2];
        for (int i = 0; i < 2; ++i) {
          const int col = (first + i) * kPanelCols;
          panels[i] = g.packed + (first + i) * panel_size;
          bias[i] = g.bias == nullptr ? nullptr : g.bias + col;
          y[i] = static_cast<char*>(g.y) + col * elem;
          cols[i] = g.N - col < kPanelCols ? g.N - col : kPanelCols;
        }
        Kernel::row_pair(g.x, panels, g.K, bias, y, g.y_bf16, cols);
      }
    }
  }
  for (int p = first; p < last; ++p) {
    const typename Kernel::Weight* panel = g.packed + p * panel_size;
    const int col = p * kPanelCols;
    const int cols = g.N - col < kPanelCols ? g.N - col : kPanelCols;
    const float* scale = g.scale == nullptr ? nullptr : g.scale + col;
    const float* bias = g.bias == nullptr ? nullptr : g.bias + col;
    char* y0 = static_cast<char*>(g.y) + col * elem;
    int m = 0;
    for (; m + kRows <= g.M; m += kRows)
      Kernel::template block<kRows>(g.x + m * g.ldx, g.ldx, panel, g.K, scale, bias,
                                    y0 + m * g.ldy * elem, g.ldy, g.y_bf16, cols);
    tail_block<Kernel, kRows - 1>(g.M - m, g.x + m * g.ldx, g.ldx, panel, g.K, scale, bias,
                                  y0 + m * g.ldy * elem, g.ldy, g.y_bf16, cols);
  }
}

// The whole GEMM of `g` on the shared pool; `x` is fp32 rows (stride g.ldx, converted to bf16
// once here, rows padded to an even length) unless `x_bf16`. Work items are (block of kRowBlock
// rows, run of panels), about four runs of panels per thread; under ~1 MFLOP the caller does it
// alone (waking the pool costs more), as in cpu_gemm.cpp. The summation order over k is fixed
// per output, so results do not depend on the thread count. Call it without the GIL.
template <class Kernel>
void run_gemm(PanelGemm<typename Kernel::Weight> g, const void* x, bool x_bf16,
              int num_threads) {
  const int M = g.M;
  const int total = num_panels(g.N);
  const int threads = 2LL * M * g.N * g.K < 1000000 ? 1 : num_threads;
  const int row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int runs = threads <= 1 ? 1 : std::min(total, 4 * threads);
  std::vector<uint16_t> converted;
  if (x_bf16) {
    g.x = static_cast<const uint16_t*>(x);
  } else {
    g.ldx = rows_to_bf16(threads, static_cast<const float*>(x), M, g.K, g.ldx, converted);
    g.x = converted.data();
  }
  const int64_t elem = g.y_bf16 ? 2 : 4;
  auto item = [&](int i) {
    const int rb = i / runs, run = i % runs;
    PanelGemm<typename Kernel::Weight> part = g;
    const int row0 = rb * kRowBlock;
    part.M = std::min(kRowBlock, M - row0);
    part.x += row0 * g.ldx;
    part.y = static_cast<char*>(g.y) + row0 * g.ldy * elem;
    run_panels<Kernel>(part, static_cast<int>(static_cast<int64_t>(total) * run / runs),
                       static_cast<int>(static_cast<int64_t>(total) * (run + 1) / runs));
  };
  run_items(threads, row_blocks * runs, item);
}

}  // namespace
