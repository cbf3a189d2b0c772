// The 16 x 16 transpose of 32-bit lanes that packs bf16 key pairs for vdpbf16ps: 16 keys' rows
// of 16 pairs (dims 2j, 2j+1 as one u32) become 16 rows of one pair across the 16 keys. Shared by
// the fresh-prompt kernel's AVX512-BF16 path (ext/cpu_prefill_attention_dp.h) and the paged
// kernel's (ext/cpu_attention_paged_dp.h); a scalar copy per pair and key cost them about as much
// as the score products themselves.
#pragma once

#include <immintrin.h>

// r[0 .. 16) -> its transpose, in place (r[j] lane t = r[t] lane j before).
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
transpose16_u32(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + k], 128-bit lane L: rows 4i .. 4i+3 of column 4L + k
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i x = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x88);  // lanes 0, 2 of each
    const __m512i y = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xDD);  // lanes 1, 3
    const __m512i z = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x88);
    const __m512i w = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(x, z, 0x88);       // column k (lane 0)
    r[4 + k] = _mm512_shuffle_i32x4(y, w, 0x88);   // column 4 + k (lane 1)
    r[8 + k] = _mm512_shuffle_i32x4(x, z, 0xDD);   // column 8 + k (lane 2)
    r[12 + k] = _mm512_shuffle_i32x4(y, w, 0xDD);  // column 12 + k (lane 3)
  }
}

// Keys t = 0 .. n-1 (n <= 64; key t's D bf16 at row(t)) -> [D/2][64][2] u32 pairs, zero past n:
// 16 keys x 16 pairs at a time, the pairs past the last whole 16 one by one.
template <typename Row>
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
pack_key_pairs_64(Row row, int n, int D, uint32_t* packed) {
  constexpr int kKeys = 64;
  const int pairs = D / 2;
  const int whole = pairs & ~15;
  for (int t0 = 0; t0 < kKeys; t0 += 16) {
    for (int j0 = 0; j0 < whole; j0 += 16) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t)
        r[t] = t0 + t < n ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(row(t0 + t)) + j0)
                          : _mm512_setzero_si512();
      transpose16_u32(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(packed + (j0 + j) * kKeys + t0, r[j]);
    }
  }
  for (int t = 0; t < kKeys; ++t) {
    const uint32_t* src = t < n ? reinterpret_cast<const uint32_t*>(row(t)) : nullptr;
    for (int j = whole; j < pairs; ++j) packed[j * kKeys + t] = src ? src[j] : 0;
  }
}
