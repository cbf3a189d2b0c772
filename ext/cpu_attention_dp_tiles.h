// The vdpbf16ps tiles of the two bf16 attention kernels for CPUs with AVX512-BF16: the
// fresh-prompt kernel's (ext/cpu_prefill_attention_dp.h) and the paged kernel's long chunks with
// context (ext/cpu_attention_paged_dp.h). Each keeps its own setup (which rows, where its keys
// are); a 64-key tile's keys and values come as row pointers, so contiguous rows and rows
// gathered from the block-paged cache share the packing, the products and the softmax pass:
//   S = Q . K^T: q rows read as bf16 pairs (dims 2j, 2j+1) broadcast against a 64-key tile
//     packed [D/2][64][2] (ext/cpu_bf16_pair_pack.h), 6 rows x 4 zmm of sums;
//   the scores' two roundings (ext/cpu_attention_bf16.h) and each row's running max on the
//     score registers, the scores kept as bf16 (what they are once rounded), then per row one
//     pass of exp and sum (16 lanes, into an fp32 row) and one of p rounded to bf16 over the
//     row's scores: the rounded softmax of ext/cpu_attention_bf16.h in three passes fewer;
//   O = P . V: P's rows are bf16 values already (rounded by the softmax), so their bf16 copy is
//     exact; its key pairs broadcast against the 64-key tile of V packed [32][D][2].
// The sums are fp32, in pairs; vdpbf16ps treats bf16 subnormal inputs as zero.
// Anonymous namespace: a copy per source file. Include after ext/cpu_attention_bf16.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_attention_bf16.h"
#include "cpu_bf16_pair_pack.h"
#include "cpu_common.h"

#define TRILLM_DOT_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

constexpr int kDotKeys = 64;  // keys per tile
constexpr int kDotRows = 6;   // query vectors per register block

// Values 0 .. n-1 (n <= 64; value j's D bf16 at row(j)) -> [32][D][2]: pair j holds values 2j
// and 2j + 1 interleaved per dim (zero past n: a zero probability times a stale value must stay
// zero).
template <typename Row>
TRILLM_DOT_TARGET inline void pack_value_pairs(Row row, int n, int D, uint16_t* packed) {
  for (int j = 0; j < (n + 1) / 2; ++j) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(row(2 * j));
    const bool odd = 2 * j + 1 < n;
    const uint16_t* r1 = odd ? reinterpret_cast<const uint16_t*>(row(2 * j + 1)) : r0;
    for (int d = 0; d < D; d += 16) {
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r0 + d)));
      const __m512i b = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r1 + d)))
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(packed + (static_cast<int64_t>(j) * D + d) * 2,
                          _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// A tile packed once for every item that reads it (the paged kernel's long chunks: each kv
// head's keys and values of a request packed once per call, not once per item): its 64 keys'
// pairs [D/2][64][2] (pack_key_pairs_64), then their values' [32][D][2] (pack_value_pairs).
constexpr int64_t kDotTileElems(int D) { return 2 * static_cast<int64_t>(kDotKeys) * D; }

// Keys (values false) or values key0 .. key0 + n -> row pointers: tile_rows(values, key0, n).
template <typename TileRows>
TRILLM_DOT_TARGET inline void pack_dot_tile(TileRows& tile_rows, int key0, int n, int D,
                                            uint16_t* tile) {
  const Bf16* const* rows = tile_rows(false, key0, n);
  pack_key_pairs_64([rows](int t) { return rows[t]; }, n, D, reinterpret_cast<uint32_t*>(tile));
  rows = tile_rows(true, key0, n);
  pack_value_pairs([rows](int t) { return rows[t]; }, n, D, tile + kDotKeys * D);
}

// bf16 -> fp32, 16 lanes.
TRILLM_DOT_TARGET inline __attribute__((always_inline)) __m512 widen16_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x rounded to bf16 (to nearest even; subnormal inputs and results flush to zero: an exp or
// score that small changes no rounded probability, and vdpbf16ps reads a subnormal p as zero).
TRILLM_DOT_TARGET inline __attribute__((always_inline)) __m256i round16_bf16(__m512 x) {
  return (__m256i)_mm512_cvtneps_pbh(x);
}

// exp(x) for x <= 0 (-inf -> 0), 16 lanes: exp_nonpositive's (ext/cpu_common.h) range reduction
// and polynomial.
TRILLM_DOT_TARGET inline __attribute__((always_inline)) __m512 exp16_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  const __m512 nf = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, nf));
}

// s[i][0 .. cols) = the rounded scores (round_scores, ext/cpu_attention_bf16.h: bf16 values, kept
// as bf16) of q[i] . tile for R query vectors (q rows of D bf16, s rows of lds); rmax[i] = the
// largest of them with keys key0 + c <= pos[i] (the scores vector i sees; the rest are stored but
// not counted). NC: the tile's first 16 NC keys computed (cols <= 16 NC: a block on the causal
// diagonal sees fewer than 64). unscaled: scale is a power of two, so the second rounding
// (round(round(sum) * scale)) is exact and is left to the softmax: s holds round(sum) and the
// softmax's fmsub(s, scale, max * scale) gives the same fp32 difference as the scaled scores
// (each product exact; the scaled scores a flushed subnormal would move no exp: its row's
// exps are all 1 then).
template <int R, int NC>
TRILLM_DOT_TARGET inline __attribute__((always_inline)) void dot_scores(
    const uint16_t* q, int D, const uint32_t* tile, uint16_t* s, int64_t lds, int cols,
    __m512 scale, bool unscaled, const int* pos, int key0, float* rmax) {
  __m512 acc[R][NC];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int j = 0; j < D / 2; ++j) {
    const uint32_t* w = tile + j * kDotKeys;
    __m512bh wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + 16 * c);
    for (int i = 0; i < R; ++i) {
      int32_t pr;
      std::memcpy(&pr, q + i * D + 2 * j, 4);
      const __m512bh qi = (__m512bh)_mm512_set1_epi32(pr);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], qi, wv[c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const int vis = std::min(cols, pos[i] - key0 + 1);  // >= 0: row i sees key0 .. key0+vis-1
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < NC; ++c) {
      const int left = cols - 16 * c;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      __m256i h = round16_bf16(acc[i][c]);
      if (!unscaled) h = round16_bf16(_mm512_mul_ps(widen16_bf16(h), scale));
      _mm256_mask_storeu_epi16(s + i * lds + 16 * c, mask, h);
      const __m512 r = widen16_bf16(h);
      const int seen = vis - 16 * c;
      if (seen > 0) {
        const __mmask16 m = seen >= 16 ? 0xffff : static_cast<__mmask16>((1u << seen) - 1);
        mx = _mm512_mask_max_ps(mx, m, mx, r);
      }
    }
    if (vis > 0) rmax[i] = std::max(rmax[i], _mm512_reduce_max_ps(mx));
  }
}

// dot_scores with NC = the 16-key columns that `cols` needs.
template <int R>
TRILLM_DOT_TARGET inline __attribute__((always_inline)) void dot_scores_cols(
    const uint16_t* q, int D, const uint32_t* tile, uint16_t* s, int64_t lds, int cols,
    __m512 scale, bool unscaled, const int* pos, int key0, float* rmax) {
  switch ((cols + 15) / 16) {
    case 4: dot_scores<R, 4>(q, D, tile, s, lds, cols, scale, unscaled, pos, key0, rmax); break;
    case 3: dot_scores<R, 3>(q, D, tile, s, lds, cols, scale, unscaled, pos, key0, rmax); break;
    case 2: dot_scores<R, 2>(q, D, tile, s, lds, cols, scale, unscaled, pos, key0, rmax); break;
    default: dot_scores<R, 1>(q, D, tile, s, lds, cols, scale, unscaled, pos, key0, rmax); break;
  }
}

// Whether x is a power of two (a normal float): scores times it round exactly.
inline bool power_of_two(float x) {
  int e;
  return x > 0.0f && std::isnormal(x) && std::frexp(x, &e) == 0.5f;
}

// acc's D floats (D a multiple of 16) -> bf16 at dst, each as store(Bf16*, float) rounds it
// (ext/cpu_common.h: to nearest even, a NaN kept a quiet NaN, nothing flushed), 16 at a time.
TRILLM_DOT_TARGET inline void store_row_bf16(Bf16* dst, const float* acc, int D) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x400000);
  for (int d = 0; d < D; d += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(acc + d));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, magnitude), inf);
    __m512i r = _mm512_add_epi32(
        u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    r = _mm512_mask_or_epi32(r, nan, u, quiet);  // NaN: (u >> 16) | 0x40 below
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
}

// o[i][0 .. 16 NV) += sum over pairs j < npairs of p[i][2j, 2j+1] . tile[j] for R vectors
// (p rows of ldp bf16, o rows of D floats, tile [pairs][D][2] at the first of these columns).
template <int R, int NV>
TRILLM_DOT_TARGET inline __attribute__((always_inline)) void dot_accumulate(
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
TRILLM_DOT_TARGET inline __attribute__((always_inline)) void dot_accumulate_cols(
    const uint16_t* p, int64_t ldp, const uint16_t* tile, int D, int npairs, float* o) {
  for (int c0 = 0; c0 < D; c0 += 64) {  // 64 output dims (4 zmm of sums per row) at a time
    const uint16_t* t = tile + 2 * c0;
    switch ((std::min(64, D - c0)) / 16) {
      case 4: dot_accumulate<R, 4>(p, ldp, t, D, npairs, o + c0); break;
      case 3: dot_accumulate<R, 3>(p, ldp, t, D, npairs, o + c0); break;
      case 2: dot_accumulate<R, 2>(p, ldp, t, D, npairs, o + c0); break;
      default: dot_accumulate<R, 1>(p, ldp, t, D, npairs, o + c0); break;
    }
  }
}

// A bf16 work item's three passes: M <= 96 query vectors qs [M][D] (bf16; D a multiple of 16 up
// to 256), vector i at key position pos[i] (non-decreasing) and seeing keys 0 .. pos[i];
// tile_rows(values, key0, n) -> the n row pointers (const Bf16*) of keys (values false) or
// values (true) key0 .. key0 + n. (1) every score the item's vectors see, rounded twice, and
// each vector's largest; (2) per row the rounded softmax in bf16, 0 past the row's position
// up to the next tile's end (a block's later vectors read those); (3) acc [M][D] += P . V
// (pairs: an odd count's partner key has p = 0 for every row of the block and a zero value).
// shared: nullptr (each tile packed here, from tile_rows) or the tiles packed already, tile t at
// shared + t * kDotTileElems(D) (pack_dot_tile; keys past this item's may follow in its last
// tile: their scores are neither kept nor counted; an odd count's last value tile is packed
// here, its partner zero as above).
template <typename TileRows>
TRILLM_DOT_TARGET inline void dot_item_tiles(const uint16_t* qs, int M, int D, const int* pos,
                                             float scale, TileRows&& tile_rows, float* acc,
                                             const uint16_t* shared = nullptr) {
  const int key_end = pos[M - 1] + 1;
  const int stride = (key_end + kDotKeys - 1) / kDotKeys * kDotKeys;  // whole tiles
  alignas(64) static thread_local uint32_t kp[kDotKeys / 2 * 256];    // K pairs (D <= 256)
  alignas(64) static thread_local uint16_t vp[kDotKeys * 256];        // V pairs
  static thread_local std::vector<uint16_t> sp_all;  // [M][stride] bf16: S, then P in its place
  if (sp_all.size() < static_cast<size_t>(M) * stride)
    sp_all.resize(static_cast<size_t>(M) * stride);
  uint16_t* S = sp_all.data();
  uint16_t* P = S;
  float* E = score_rows(1, stride);  // one row's exps
  float rmax[96];  // per vector: its largest visible rounded score
  for (int i = 0; i < M; ++i) rmax[i] = -INFINITY;
  const __m512 vscale = _mm512_set1_ps(scale);
  const bool unscaled = power_of_two(scale);  // S holds round(sum); the softmax scales (dot_scores)

  for (int key0 = 0; key0 < key_end; key0 += kDotKeys) {
    const int n = std::min(kDotKeys, key_end - key0);
    const uint32_t* kt = kp;
    if (shared != nullptr) {
      kt = reinterpret_cast<const uint32_t*>(shared + key0 / kDotKeys * kDotTileElems(D));
    } else {
      const Bf16* const* rows = tile_rows(false, key0, n);
      pack_key_pairs_64([rows](int t) { return rows[t]; }, n, D, kp);
    }
    for (int i = 0; i < M; i += kDotRows) {
      const int nrows = std::min(kDotRows, M - i);
      const int seen = std::min(n, pos[i + nrows - 1] - key0 + 1);
      if (seen <= 0) continue;
      uint16_t* s = S + static_cast<int64_t>(i) * stride + key0;
      const uint16_t* qi = qs + i * D;
      float* mx = rmax + i;
      const int* pi = pos + i;
      switch (nrows) {  // (no generic lambda: it would not carry this function's target)
        case 6: dot_scores_cols<6>(qi, D, kt, s, stride, seen, vscale, unscaled, pi, key0, mx); break;
        case 5: dot_scores_cols<5>(qi, D, kt, s, stride, seen, vscale, unscaled, pi, key0, mx); break;
        case 4: dot_scores_cols<4>(qi, D, kt, s, stride, seen, vscale, unscaled, pi, key0, mx); break;
        case 3: dot_scores_cols<3>(qi, D, kt, s, stride, seen, vscale, unscaled, pi, key0, mx); break;
        case 2: dot_scores_cols<2>(qi, D, kt, s, stride, seen, vscale, unscaled, pi, key0, mx); break;
        default: dot_scores_cols<1>(qi, D, kt, s, stride, seen, vscale, unscaled, pi, key0, mx); break;
      }
    }
  }
  // Per row the rounded softmax of its n scores (rounded_softmax_row, ext/cpu_attention_bf16.h:
  // p = exp(s - max) * (1 / sum), rounded to bf16) straight into P's bf16 row, 0 past n up to the
  // next tile's end.
  for (int i = 0; i < M; ++i) {
    const uint16_t* row = S + static_cast<int64_t>(i) * stride;
    uint16_t* prow = P + static_cast<int64_t>(i) * stride;
    const int n = pos[i] + 1;
    // x = s * sscale - max * sscale: the scaled score's difference (both products exact).
    const float sscale = unscaled ? scale : 1.0f;
    const __m512 vs = _mm512_set1_ps(sscale);
    const __m512 shift = _mm512_set1_ps(rmax[i] * sscale);
    __m512 sum = _mm512_setzero_ps();
    int c = 0;
    for (; c + 16 <= n; c += 16) {
      const __m512 x = widen16_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
      const __m512 e = exp16_nonpositive(_mm512_fmsub_ps(x, vs, shift));
      _mm512_storeu_ps(E + c, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (c < n) {  // lanes past n: 0
      const __mmask16 mask = static_cast<__mmask16>((1u << (n - c)) - 1);
      const __m512 x = widen16_bf16(_mm256_maskz_loadu_epi16(mask, row + c));
      const __m512 e = _mm512_maskz_mov_ps(mask, exp16_nonpositive(_mm512_fmsub_ps(x, vs, shift)));
      _mm512_storeu_ps(E + c, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    const int end = std::min(stride, (n + kDotKeys - 1) / kDotKeys * kDotKeys + kDotKeys);
    for (c = 0; c < n; c += 16)  // (the partial vector's lanes past n were stored as 0)
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(prow + c),
          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(E + c), inv)));
    for (; c < end; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + c), _mm256_setzero_si256());
  }
  for (int key0 = 0; key0 < key_end; key0 += kDotKeys) {
    const int n = std::min(kDotKeys, key_end - key0);
    const uint16_t* vt = vp;
    if (shared != nullptr && n % 2 == 0) {
      vt = shared + key0 / kDotKeys * kDotTileElems(D) + kDotKeys * D;
    } else {
      const Bf16* const* rows = tile_rows(true, key0, n);
      pack_value_pairs([rows](int t) { return rows[t]; }, n, D, vp);
    }
    for (int i = 0; i < M; i += kDotRows) {
      const int nrows = std::min(kDotRows, M - i);
      const int keys = std::min(n, pos[i + nrows - 1] - key0 + 1);
      if (keys <= 0) continue;
      const uint16_t* pi = P + static_cast<int64_t>(i) * stride + key0;
      const int pairs = (keys + 1) / 2;
      float* o = acc + i * D;
      switch (nrows) {
        case 6: dot_accumulate_cols<6>(pi, stride, vt, D, pairs, o); break;
        case 5: dot_accumulate_cols<5>(pi, stride, vt, D, pairs, o); break;
        case 4: dot_accumulate_cols<4>(pi, stride, vt, D, pairs, o); break;
        case 3: dot_accumulate_cols<3>(pi, stride, vt, D, pairs, o); break;
        case 2: dot_accumulate_cols<2>(pi, stride, vt, D, pairs, o); break;
        default: dot_accumulate_cols<1>(pi, stride, vt, D, pairs, o); break;
      }
    }
  }
}

// A whole bf16 item: `item` (FreshBf16Item, PagedChunk) gives M, D, pos, q_row(i), the tile
// rows (operator()) and out_row(i); its q rows copied, the passes, the rows stored. shared: see
// dot_item_tiles.
template <typename ItemT>
TRILLM_DOT_TARGET inline void dot_attend_item(ItemT& item, float scale,
                                              const uint16_t* shared = nullptr) {
  alignas(64) static thread_local uint16_t qs[96 * 256];  // [M][D] bf16
  alignas(64) static thread_local float acc[96 * 256];    // [M][D]
  const int D = item.D;
  for (int i = 0; i < item.M; ++i) {
    std::memcpy(qs + i * D, item.q_row(i), D * sizeof(uint16_t));
    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(acc + i * D + d, _mm512_setzero_ps());
  }
  dot_item_tiles(qs, item.M, D, item.pos, scale, item, acc, shared);
  for (int i = 0; i < item.M; ++i) store_row_bf16(item.out_row(i), acc + i * D, D);
}

}  // namespace
