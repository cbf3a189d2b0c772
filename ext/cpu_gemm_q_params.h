// A quantized record's per-block parameters for one panel's 16 columns, as fp32 vectors:
// included by ext/cpu_gemm_q.cpp inside its anonymous namespace (after kCols and
// TRILLM_Q_TARGET), where every GEMM path that reads them (the fp32 tile's `add_block`, the
// int8 prefill path's unpacking in cpu_gemm_q_vnni_prefill.h) takes them from here.

// Q4_K: the block's scale d * sc and its minimum's factor dmin * mn (the value is
// (d sc) q - (dmin mn)), from a record whose `params` are d[16] fp16, dmin[16] fp16, sc[16]
// uint8, mn[16] uint8; `d` the record's d, loaded. Each product is exact in fp32 (11-bit
// mantissas times 6-bit integers).
struct Q4KScales {
  __m512 scale;    // d * sc
  __m512 minimum;  // dmin * mn
};

TRILLM_Q_TARGET inline Q4KScales load_q4_k_scales(const uint8_t* params, __m512 d) {
  const __m512 dmin = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 2 * kCols)));
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 4 * kCols))));
  const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 5 * kCols))));
  return {_mm512_mul_ps(d, sc), _mm512_mul_ps(dmin, mn)};
}
