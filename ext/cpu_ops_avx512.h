// SiLU-and-multiply over 16 lanes (AVX512F/BW/VL), for cpu_ops.cpp's silu_and_mul where the CPU
// has them: the same operations as its 8-lane kernel in the same order (exp_any and
// exp_nonpositive of cpu_common.h, the division, bf16 round-to-nearest-even done on the bits),
// so each lane's result is the same to the bit; twice the lanes a step and masked tails instead
// of the 8-lane kernel's copies through a buffer. Included by cpu_ops.cpp only, after its
// fp-contract=off pragma: no product here is fused into an add.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu_common.h"

#define TRILLM_AVX512_OPS __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace trillm_cpu_ops_avx512 {

TRILLM_AVX512_OPS inline __m512 splat(float x) { return _mm512_set1_ps(x); }

// cpu_common.h's exp_nonpositive, lane for lane.
TRILLM_AVX512_OPS inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live =
      _mm512_cmp_ps_mask(x, splat(-std::numeric_limits<float>::infinity()), _CMP_NEQ_UQ);
  x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, splat(-87.0f), _CMP_LT_OS), x, splat(-87.0f));
  const __m512 fx = _mm512_add_ps(_mm512_mul_ps(x, splat(1.44269504088896341f)), splat(0.5f));
  __m512i n = _mm512_cvttps_epi32(fx);  // truncates toward zero; floor below
  __m512 nf = _mm512_cvtepi32_ps(n);
  n = _mm512_mask_sub_epi32(n, _mm512_cmp_ps_mask(nf, fx, _CMP_GT_OS), n, _mm512_set1_epi32(1));
  nf = _mm512_cvtepi32_ps(n);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(nf, splat(0.693359375f))),
                                 _mm512_mul_ps(nf, splat(-2.12194440e-4f)));
  __m512 y = splat(1.9875691500e-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, r), splat(1.3981999507e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), splat(8.3334519073e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), splat(4.1665795894e-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), splat(1.6666665459e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), splat(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, r), r), r), splat(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(live, _mm512_mul_ps(y, _mm512_castsi512_ps(bits)));
}

// cpu_ops.cpp's exp_any, lane for lane.
TRILLM_AVX512_OPS inline __m512 exp_any(__m512 x) {
  x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, splat(89.0f), _CMP_GT_OS), x, splat(89.0f));
  const __mmask16 big = _mm512_cmp_ps_mask(x, splat(88.0f), _CMP_GT_OS);
  const __m512 e =
      exp_nonpositive(_mm512_mask_blend_ps(big, x, _mm512_sub_ps(x, splat(0.693147182f))));
  return _mm512_mask_blend_ps(big, e, _mm512_mul_ps(e, splat(2.0f)));
}

// The bits of each lane rounded to bf16 (low 16 bits zero; NaN made quiet), as cpu_ops.cpp's
// bf16_bits.
TRILLM_AVX512_OPS inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), high);
  const __m512i quiet = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), high);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

TRILLM_AVX512_OPS inline __m512 round_to_bf16(__m512 x) {
  return _mm512_castsi512_ps(bf16_bits(x));
}

// The first lanes of mask (all 16 for a full chunk) from p as fp32; the others read as 0.
TRILLM_AVX512_OPS inline __m512 load(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
TRILLM_AVX512_OPS inline __m512 load(const Bf16* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TRILLM_AVX512_OPS inline void store(float* p, __m512 x, __mmask16 mask) {
  _mm512_mask_storeu_ps(p, mask, x);
}
TRILLM_AVX512_OPS inline void store(Bf16* p, __m512 x, __mmask16 mask) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(x), 16));
  _mm256_mask_storeu_epi16(p, mask, h);
}

// out[i] = T(silu(gate[i])) * up[i] for i < width, rounded to T.
template <typename T>
TRILLM_AVX512_OPS void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t width) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 mask =
        width - i >= 16 ? static_cast<__mmask16>(0xffff)
                        : static_cast<__mmask16>((1u << static_cast<unsigned>(width - i)) - 1u);
    const __m512 g = load(gate + i, mask);
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
    __m512 silu = _mm512_div_ps(g, _mm512_add_ps(splat(1.0f), exp_any(neg)));
    if constexpr (std::is_same_v<T, Bf16>) silu = round_to_bf16(silu);
    store(out + i, _mm512_mul_ps(silu, load(up + i, mask)), mask);
  }
}

// Whether these kernels may run here.
inline bool cpu_has_avx512_ops() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

}  // namespace trillm_cpu_ops_avx512

#endif
