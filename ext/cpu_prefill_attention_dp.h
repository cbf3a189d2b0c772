// The fresh-prompt kernel's bf16 path on CPUs with AVX512-BF16 (included by
// ext/cpu_prefill_attention.cpp after its AVX2 code): the same item, the same rounding points
// (ext/cpu_attention_bf16.h), but both products run on vdpbf16ps, 32 bf16 products a zmm
// summed into 16 fp32 lanes in pairs, twice the multiply rate of the AVX2 path's fp32 FMAs and
// no bf16 -> fp32 widening of q, k or v:
//   S = Q . K^T: q rows read as bf16 pairs (dims 2j, 2j+1) broadcast against a 64-key tile
//     packed [D/2][64][2] (each key's two dims side by side), 6 rows x 4 zmm of sums;
//   the scores' two roundings and the rounded softmax: unchanged (fp32 rows);
//   O = P . V: P's rows are bf16 values already (rounded by the softmax), so their bf16 copy is
//     exact; its key pairs broadcast against the 64-key tile of V packed [32][D][2].
// The sums are fp32 as in the AVX2 path, in another order (pairs), like any GEMM's; vdpbf16ps
// treats bf16 subnormal inputs as zero.
#pragma once

#include "cpu_bf16_pair_pack.h"

#define TRILLM_DP_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

// Keys 0 .. n-1 (n <= 64; rows of `k`, stride ld, D bf16 each) -> [D/2][64][2] (zero past n),
// by 16 x 16 transposes (ext/cpu_bf16_pair_pack.h).
TRILLM_DP_TARGET inline void pack_key_pairs(const Bf16* k, int64_t ld, int n, int D,
                                            uint32_t* packed) {
  pack_key_pairs_64([k, ld](int t) { return k + t * ld; }, n, D, packed);
}

// Values 0 .. n-1 (n <= 64) -> [32][D][2]: pair j holds rows 2j and 2j+1 interleaved per dim
// (zero past n: a zero probability times a stale value must stay zero).
TRILLM_DP_TARGET inline void pack_value_pairs(const Bf16* v, int64_t ld, int n, int D,
                                              uint16_t* packed) {
  for (int j = 0; j < (n + 1) / 2; ++j) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(v + (2 * j) * ld);
    const bool odd = 2 * j + 1 < n;
    const uint16_t* r1 = reinterpret_cast<const uint16_t*>(v + (2 * j + 1) * ld);
    for (int d = 0; d < D; d += 16) {
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r0 + d)));
      const __m512i b = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r1 + d)))
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(packed + (static_cast<int64_t>(j) * D + d) * 2,
                          _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// s[i][0 .. cols) = q[i] . tile for R query vectors (q rows of D bf16, s rows of lds floats).
template <int R>
TRILLM_DP_TARGET inline __attribute__((always_inline)) void dp_scores(const uint16_t* q, int D,
                                                                      const uint32_t* tile,
                                                                      float* s, int64_t lds,
                                                                      int cols) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int j = 0; j < D / 2; ++j) {
    const uint32_t* w = tile + j * kKeyTile;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 16);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 48);
    for (int i = 0; i < R; ++i) {
      int32_t pr;
      std::memcpy(&pr, q + i * D + 2 * j, 4);
      const __m512bh qi = (__m512bh)_mm512_set1_epi32(pr);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qi, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qi, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], qi, w2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], qi, w3);
    }
  }
  for (int c = 0; c < 4; ++c) {
    const int left = cols - 16 * c;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(s + i * lds + 16 * c, mask, acc[i][c]);
  }
}

// o[i][0 .. 16 NV) += sum over pairs j < npairs of p[i][2j, 2j+1] . tile[j] for R vectors
// (p rows of ldp bf16, o rows of D floats, tile [pairs][D][2] at the first of these columns).
template <int R, int NV>
TRILLM_DP_TARGET inline __attribute__((always_inline)) void dp_accumulate(
    const uint16_t* p, int64_t ldp, const uint16_t* tile, int D, int npairs, float* o) {
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_loadu_ps(o + i * D + 16 * c);
  for (int j = 0; j < npairs; ++j) {
    const uint16_t* w = tile + static_cast<int64_t>(j) * D * 2;
    __m512bh wv[NV];
    for (int c = 0; c < NV; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + 32 * c);
    for (int i = 0; i < R; ++i) {
      int32_t pr;
      std::memcpy(&pr, p + i * ldp + 2 * j, 4);
      const __m512bh pi = (__m512bh)_mm512_set1_epi32(pr);
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pi, wv[c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + i * D + 16 * c, acc[i][c]);
}

template <int R>
TRILLM_DP_TARGET inline __attribute__((always_inline)) void dp_accumulate_cols(
    const uint16_t* p, int64_t ldp, const uint16_t* tile, int D, int npairs, float* o) {
  for (int c0 = 0; c0 < D; c0 += 64) {  // 64 output dims (4 zmm of sums per row) at a time
    const uint16_t* t = tile + 2 * c0;
    switch ((std::min(64, D - c0)) / 16) {
      case 4: dp_accumulate<R, 4>(p, ldp, t, D, npairs, o + c0); break;
      case 3: dp_accumulate<R, 3>(p, ldp, t, D, npairs, o + c0); break;
      case 2: dp_accumulate<R, 2>(p, ldp, t, D, npairs, o + c0); break;
      default: dp_accumulate<R, 1>(p, ldp, t, D, npairs, o + c0); break;
    }
  }
}

// attend_item_bf16 (ext/cpu_prefill_attention.cpp) with both products on vdpbf16ps.
TRILLM_DP_TARGET void attend_item_bf16_dp(const Problem& p, const Item& it) {
  const int D = p.head_dim;
  const int group = p.num_heads / p.num_kv_heads;
  const int M = (it.last - it.first) * group;  // vector i: position first + i / group
  const int stride = (it.last + kKeyTile - 1) / kKeyTile * kKeyTile;  // whole tiles

  alignas(64) static thread_local uint16_t qs[kMaxVectors * kMaxHeadDim];  // [M][D] bf16
  alignas(64) static thread_local float acc[kMaxVectors * kMaxHeadDim];    // [M][D]
  alignas(64) static thread_local uint32_t kp[kKeyTile / 2 * kMaxHeadDim];   // K tile pairs
  alignas(64) static thread_local uint16_t vp[kKeyTile * kMaxHeadDim];     // V tile pairs
  static thread_local std::vector<uint16_t> pb_all;  // [M][stride]: P in bf16
  float* S = score_rows(M, stride);  // [M][stride]: S, then P
  if (pb_all.size() < static_cast<size_t>(M) * stride) pb_all.resize(static_cast<size_t>(M) * stride);
  uint16_t* P = pb_all.data();
  int pos[kMaxVectors];

  const Bf16* q = static_cast<const Bf16*>(p.q);
  for (int i = 0; i < M; ++i) {
    pos[i] = it.first + i / group;
    const int head = it.kv_head * group + i % group;
    const Bf16* src = q + (it.start + pos[i]) * p.q_token_stride + head * p.q_head_stride;
    std::memcpy(qs + i * D, src, D * sizeof(uint16_t));
    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(acc + i * D + d, _mm512_setzero_ps());
  }
  const Bf16* k = static_cast<const Bf16*>(p.k) + it.start * p.k_token_stride +
                  it.kv_head * p.k_head_stride;
  const Bf16* v = static_cast<const Bf16*>(p.v) + it.start * p.v_token_stride +
                  it.kv_head * p.v_head_stride;

  // (1) S = Q . K^T over the keys some vector of a block sees.
  for (int key0 = 0; key0 < it.last; key0 += kKeyTile) {
    const int n = std::min(kKeyTile, it.last - key0);
    pack_key_pairs(k + key0 * p.k_token_stride, p.k_token_stride, n, D, kp);
    for (int i = 0; i < M; i += kRows) {
      const int rows = std::min(kRows, M - i);
      const int seen = std::min(n, pos[i + rows - 1] - key0 + 1);
      if (seen <= 0) continue;
      float* s = S + i * stride + key0;
      const uint16_t* qi = qs + i * D;
      switch (rows) {  // (no generic lambda: it would not carry this function's target)
        case 6: dp_scores<6>(qi, D, kp, s, stride, seen); break;
        case 5: dp_scores<5>(qi, D, kp, s, stride, seen); break;
        case 4: dp_scores<4>(qi, D, kp, s, stride, seen); break;
        case 3: dp_scores<3>(qi, D, kp, s, stride, seen); break;
        case 2: dp_scores<2>(qi, D, kp, s, stride, seen); break;
        default: dp_scores<1>(qi, D, kp, s, stride, seen); break;
      }
    }
  }
  // (2) Per row: the scores' roundings, the rounded softmax, then its bf16 copy (exact), zero
  // past the row's position up to the tile's end (a block's later vectors read those columns).
  const v8f scale = splat(p.scale);
  for (int i = 0; i < M; ++i) {
    float* row = S + static_cast<int64_t>(i) * stride;
    uint16_t* prow = P + static_cast<int64_t>(i) * stride;
    const int n = pos[i] + 1;
    for (int c = 0; c < n; c += 8) {
      const v8f r = round_scores(c + 8 <= n ? load8(row + c) : load_part(row + c, n - c, 0.0f),
                                 scale);
      std::memcpy(row + c, &r, std::min(8, n - c) * sizeof(float));
    }
    rounded_softmax_row(row, n);
    const int end = std::min(stride, (n + kKeyTile - 1) / kKeyTile * kKeyTile + kKeyTile);
    int c = 0;
    for (; c + 16 <= n; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + c)));
    if (c < n) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (n - c)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(mask, row + c);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + c), (__m256i)_mm512_cvtneps_pbh(x));
      c += 16;
    }
    for (; c < end; c += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + c),
                                                 _mm256_setzero_si256());
  }
  // (3) O = P . V over the keys the block's last vector sees (pairs: an odd count's partner
  // key has p = 0 for every row of the block and a zero value).
  for (int key0 = 0; key0 < it.last; key0 += kKeyTile) {
    const int n = std::min(kKeyTile, it.last - key0);
    pack_value_pairs(v + key0 * p.v_token_stride, p.v_token_stride, n, D, vp);
    for (int i = 0; i < M; i += kRows) {
      const int rows = std::min(kRows, M - i);
      const int keys = std::min(n, pos[i + rows - 1] - key0 + 1);
      if (keys <= 0) continue;
      const uint16_t* pi = P + i * stride + key0;
      const int pairs = (keys + 1) / 2;
      float* o = acc + i * D;
      switch (rows) {
        case 6: dp_accumulate_cols<6>(pi, stride, vp, D, pairs, o); break;
        case 5: dp_accumulate_cols<5>(pi, stride, vp, D, pairs, o); break;
        case 4: dp_accumulate_cols<4>(pi, stride, vp, D, pairs, o); break;
        case 3: dp_accumulate_cols<3>(pi, stride, vp, D, pairs, o); break;
        case 2: dp_accumulate_cols<2>(pi, stride, vp, D, pairs, o); break;
        default: dp_accumulate_cols<1>(pi, stride, vp, D, pairs, o); break;
      }
    }
  }

  for (int i = 0; i < M; ++i) {
    const int head = it.kv_head * group + i % group;
    Bf16* dst = static_cast<Bf16*>(p.out) + (it.start + pos[i]) * p.out_token_stride +
                head * p.out_head_stride;
    for (int d = 0; d < D; ++d) store(dst + d, acc[i * D + d]);
  }
}

}  // namespace
