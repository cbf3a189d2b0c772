// AVX-512 BF16 pieces shared by the bf16 and fp8 GEMMs (cpu_gemm_bf16.cpp, cpu_gemm_fp8.cpp):
// the target attribute, fp32 -> bf16 rows, and storing a 64-column row of fp32 sums.
// Anonymous namespace: a copy per source file (both are small and always inlined or local).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace {

// The AVX-512 code lives only in functions with this attribute (no pragma region): an inline
// std:: template instantiated inside such a region could be the copy the linker keeps for the
// generic code too.
#define TRILLM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

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

}  // namespace
