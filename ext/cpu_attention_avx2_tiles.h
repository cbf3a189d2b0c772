// The AVX2 + FMA tiles of the attention kernels that run a work item of up to 96 query vectors
// as two small GEMMs (S = Q . K^T, then O = P . V) on 6 x 16 register blocks: the fresh-prompt
// kernel (ext/cpu_prefill_attention.cpp, fp32 and bf16) and, on CPUs without AVX512-BF16, the
// paged kernel's long bf16 chunks with context (ext/cpu_attention_paged_avx2.h). Each kernel
// keeps its own setup (which rows, where its keys are); the keys and values of a 64-key tile
// come as row pointers (a `Row` functor t -> the row of key t of the tile), so contiguous rows
// and rows gathered from the block-paged cache share the packing and the products.
//
// bf16 is widened to fp32 as it is loaded (a 16-bit shift), the products are fp32 FMAs (exact
// for bf16 inputs), the sums fp32. K^T is packed into 16-key panels [D][16] by 8 x 8 transposes;
// V into 16-column panels [D/16][n][16] (strided rows would share a few L1 sets).
// Anonymous namespace: a copy per source file. Include after ext/cpu_attention_bf16.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_attention_bf16.h"
#include "cpu_common.h"

namespace {

constexpr int kRows = 6;      // query vectors per register block
constexpr int kPanel = 16;    // keys (scores) or head-dim columns (output) per block
constexpr int kKeyTile = 64;  // keys per tile: four panels
constexpr int kTileMaxVectors = 96;   // query vectors per work item
constexpr int kTileMaxHeadDim = 256;  // head_dim: a multiple of 16 up to this

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline __attribute__((always_inline)) __m256 ld8(const float* x) { return _mm256_loadu_ps(x); }
inline __attribute__((always_inline)) __m256 ld8(const Bf16* x) { return load8(x); }

inline __attribute__((always_inline)) void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Keys 0 .. n-1 (n <= 64; key t's D values at row(t)) -> panels [ceil(n/16)][D][16], zero past n.
template <typename Row>
inline void pack_keys(Row row, int n, int D, float* packed) {
  for (int key0 = 0; key0 < n; key0 += 8) {
    const int panel = key0 / kPanel, col = key0 % kPanel;
    float* dst = packed + static_cast<int64_t>(panel) * D * kPanel + col;
    for (int d = 0; d < D; d += 8) {
      __m256 r[8];
      for (int t = 0; t < 8; ++t)
        r[t] = key0 + t < n ? ld8(row(key0 + t) + d) : _mm256_setzero_ps();
      transpose8(r);
      for (int t = 0; t < 8; ++t) _mm256_storeu_ps(dst + (d + t) * kPanel, r[t]);
    }
  }
  if (n % kPanel > 0 && n % kPanel <= 8) {  // the last panel's upper half: zero
    float* dst = packed + static_cast<int64_t>(n / kPanel) * D * kPanel + 8;
    for (int d = 0; d < D; ++d) _mm256_storeu_ps(dst + d * kPanel, _mm256_setzero_ps());
  }
}

// Values 0 .. n-1 (value j's D values at row(j)) -> panels [D/16][n][16].
template <typename Row>
inline void pack_values(Row row, int n, int D, float* packed) {
  for (int j = 0; j < n; ++j) {
    const auto* src = row(j);
    for (int c = 0; c < D; c += kPanel) {
      float* dst = packed + static_cast<int64_t>(c) * n + j * kPanel;
      _mm256_storeu_ps(dst, ld8(src + c));
      _mm256_storeu_ps(dst + 8, ld8(src + c + 8));
    }
  }
}

// s[i][0..16) = q[i] . panel for R query vectors (q rows of D floats, s rows of lds).
template <int R>
inline __attribute__((always_inline)) void scores(const float* q, int D, const float* panel,
                                                  float* s, int64_t lds = kKeyTile) {
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 w0 = _mm256_loadu_ps(panel + d * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + d * kPanel + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 qi = _mm256_broadcast_ss(q + i * D + d);
      acc[i][0] = _mm256_fmadd_ps(qi, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(qi, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(s + i * lds, acc[i][0]);
    _mm256_storeu_ps(s + i * lds + 8, acc[i][1]);
  }
}

// o[i][0..16) = o[i][0..16) * corr[i] + sum_j p[i][j] v[j][0..16) for R query vectors
// (p rows of ldp weights, o rows of D floats, v rows of stride ld).
template <int R>
inline __attribute__((always_inline)) void accumulate(const float* p, const float* v, int64_t ld,
                                                      int n, const float* corr, float* o,
                                                      int D, int64_t ldp = kKeyTile) {
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) {
    const __m256 c = _mm256_broadcast_ss(corr + i);
    acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(o + i * D), c);
    acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(o + i * D + 8), c);
  }
  for (int j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * ld);
    const __m256 v1 = _mm256_loadu_ps(v + j * ld + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 pi = _mm256_broadcast_ss(p + i * ldp + j);
      acc[i][0] = _mm256_fmadd_ps(pi, v0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(pi, v1, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(o + i * D, acc[i][0]);
    _mm256_storeu_ps(o + i * D + 8, acc[i][1]);
  }
}

// fn.template operator()<R>() for R = rows (1 .. kRows).
template <typename F>
inline __attribute__((always_inline)) void with_rows(int rows, F&& fn) {
  switch (rows) {
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 1: fn(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// A bf16 work item's three passes (ext/cpu_attention_bf16.h's rounding points): M <= 96 query
// vectors qs [M][D] (bf16 widened, unscaled), vector i at key position pos[i] (non-decreasing)
// and seeing keys 0 .. pos[i]; tile_rows(values, key0, n) -> the n row pointers (const Bf16*)
// of keys (values false) or values (true) key0 .. key0 + n. (1) every score the item's vectors
// see; (2) per row the two roundings and the rounded softmax, 0 past the row's position (a
// block's later vectors read those columns); (3) acc [M][D] += P . V, fp32.
template <typename TileRows>
inline void bf16_item_tiles(const float* qs, int M, int D, const int* pos, float scale,
                            TileRows&& tile_rows, float* acc) {
  const int key_end = pos[M - 1] + 1;
  const int stride = (key_end + kPanel - 1) / kPanel * kPanel;
  alignas(32) static thread_local float kp[kKeyTile * kTileMaxHeadDim];  // K^T panels
  alignas(32) static thread_local float vp[kKeyTile * kTileMaxHeadDim];  // V panels
  float* S = score_rows(M, stride);  // [M][stride]: S, then P
  float ones[kTileMaxVectors];
  for (int i = 0; i < M; ++i) ones[i] = 1.0f;

  for (int key0 = 0; key0 < key_end; key0 += kKeyTile) {
    const int n = std::min(kKeyTile, key_end - key0);
    const int width = (n + kPanel - 1) / kPanel * kPanel;
    const Bf16* const* rows = tile_rows(false, key0, n);
    pack_keys([rows](int t) { return rows[t]; }, n, D, kp);
    for (int i = 0; i < M; i += kRows) {
      const int nrows = std::min(kRows, M - i);
      const int seen = std::min(width, pos[i + nrows - 1] - key0 + 1);
      with_rows(nrows, [&](auto r) {
        for (int c = 0; c < seen; c += kPanel)
          scores<decltype(r)::value>(qs + i * D, D, kp + c * D,
                                     S + static_cast<int64_t>(i) * stride + key0 + c, stride);
      });
    }
  }
  const v8f vscale = splat(scale);
  for (int i = 0; i < M; ++i) {
    float* row = S + static_cast<int64_t>(i) * stride;
    const int n = pos[i] + 1;
    probabilities_of_scores(row, n, vscale);
    for (int c = n; c < stride; ++c) row[c] = 0.0f;
  }
  for (int key0 = 0; key0 < key_end; key0 += kKeyTile) {
    const int n = std::min(kKeyTile, key_end - key0);
    const Bf16* const* rows = tile_rows(true, key0, n);
    pack_values([rows](int t) { return rows[t]; }, n, D, vp);
    for (int i = 0; i < M; i += kRows) {
      const int nrows = std::min(kRows, M - i);
      const int keys = std::min(n, pos[i + nrows - 1] - key0 + 1);
      if (keys <= 0) continue;
      with_rows(nrows, [&](auto r) {
        for (int c = 0; c < D; c += kPanel)
          accumulate<decltype(r)::value>(S + static_cast<int64_t>(i) * stride + key0, vp + c * n,
                                         kPanel, keys, ones + i, acc + i * D + c, D, stride);
      });
    }
  }
}

// A whole bf16 item: `item` (FreshBf16Item, PagedChunk) gives M, D, pos, q_row(i), the tile
// rows (operator()) and store_rows; its q rows widened, the passes, the rows stored.
template <typename ItemT>
inline void bf16_attend_item(ItemT& item, float scale) {
  alignas(32) static thread_local float qs[kTileMaxVectors * kTileMaxHeadDim];   // [M][D]
  alignas(32) static thread_local float acc[kTileMaxVectors * kTileMaxHeadDim];  // [M][D]
  const int D = item.D;
  for (int i = 0; i < item.M; ++i) {
    const Bf16* src = item.q_row(i);
    for (int d = 0; d < D; d += 8) {
      _mm256_store_ps(qs + i * D + d, load8(src + d));
      _mm256_store_ps(acc + i * D + d, _mm256_setzero_ps());
    }
  }
  bf16_item_tiles(qs, item.M, D, item.pos, scale, item, acc);
  item.store_rows(acc);
}

#pragma GCC pop_options

}  // namespace
