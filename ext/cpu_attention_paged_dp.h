// The paged kernel's prompt chunks with context on CPUs with AVX512-BF16 (bf16 q, bf16 cache):
// the arithmetic of the fresh-prompt kernel's vdpbf16ps path (ext/cpu_prefill_attention_dp.h)
// with the keys and values read from the block-paged cache. Included by ext/cpu_attention.cpp
// inside its anonymous namespace, after Problem, Item and the bf16 rounding points.
//
// Why: a prompt longer than --max-num-batched-tokens is prefilled in chunks, and every chunk
// after the first attends to the cache. The tile kernel (ext/cpu_attention_tile.h) computes
// each score as a dot product of fp32 vectors, 16 query rows at a time: at Llama-3.2-1B's shape
// an 8,192-token prompt's second 4,096-token chunk ran at 32 GFLOP/s where the fresh kernel's
// first chunk ran at 100-126 (benchmarks/kernels/chunked_prefill_attention.py).
//
// Work item = (request, kv head, block of up to 96 / group query rows): every query head of the
// group at those rows (M <= 96 vectors). Its keys 0 .. context + last row, 64 at a time, are
// gathered from their blocks into a [D/2][64][2] tile of bf16 pairs; S = Q . K^T on 6 rows x 4
// zmm of sums; the scores' two roundings and the rounded softmax per row (every score of the
// item kept, as transformers' bf16 eager attention rounds p); its bf16 copy (exact); then
// O = P . V over value tiles packed [32][D][2]. Same rounding points as the tile kernel's bf16
// path; the fp32 sums in another order (pairs), like the fresh kernel's. Only for windowless,
// uncapped layers with head_dim a multiple of 16 up to 256; the rest keeps the tile kernel.
#pragma once

#include "cpu_bf16_pair_pack.h"

#define TRILLM_PDP_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kPdpKeys = 64;          // keys per tile
constexpr int kPdpRows = 6;           // query vectors per register block
constexpr int kPdpMaxVectors = 96;    // query vectors per item
constexpr int kPdpMaxHeadDim = 256;
constexpr int kPdpMinQueryRows = 16;  // shorter chunks (speculative verification): the tile kernel

inline bool paged_dp_layout(int num_heads, int num_kv_heads, int head_dim) {
  return head_dim % 16 == 0 && head_dim <= kPdpMaxHeadDim &&
         num_heads / num_kv_heads <= kPdpMaxVectors;
}

// Keys (row pointers, n <= 64, D bf16 each) -> [D/2][64][2] (zero past n).
TRILLM_PDP_TARGET inline void pdp_pack_keys(const Bf16* const* rows, int n, int D,
                                            uint32_t* packed) {
  pack_key_pairs_64([rows](int t) { return rows[t]; }, n, D, packed);
}

// Values (row pointers, n <= 64) -> [32][D][2]: pair j holds rows 2j and 2j + 1 interleaved per
// dim (zero past n: a zero probability times a stale value must stay zero).
TRILLM_PDP_TARGET inline void pdp_pack_values(const Bf16* const* rows, int n, int D,
                                              uint16_t* packed) {
  for (int j = 0; j < (n + 1) / 2; ++j) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(rows[2 * j]);
    const bool odd = 2 * j + 1 < n;
    const uint16_t* r1 = odd ? reinterpret_cast<const uint16_t*>(rows[2 * j + 1]) : r0;
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
TRILLM_PDP_TARGET inline __attribute__((always_inline)) void pdp_scores(
    const uint16_t* q, int D, const uint32_t* tile, float* s, int64_t lds, int cols) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int j = 0; j < D / 2; ++j) {
    const uint32_t* w = tile + j * kPdpKeys;
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

// o[i][0 .. 16 NV) += sum over pairs j < npairs of p[i][2j, 2j+1] . tile[j] for R vectors.
template <int R, int NV>
TRILLM_PDP_TARGET inline __attribute__((always_inline)) void pdp_accumulate(
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
TRILLM_PDP_TARGET inline __attribute__((always_inline)) void pdp_accumulate_cols(
    const uint16_t* p, int64_t ldp, const uint16_t* tile, int D, int npairs, float* o) {
  for (int c0 = 0; c0 < D; c0 += 64) {  // 64 output dims (4 zmm of sums per row) at a time
    const uint16_t* t = tile + 2 * c0;
    switch ((std::min(64, D - c0)) / 16) {
      case 4: pdp_accumulate<R, 4>(p, ldp, t, D, npairs, o + c0); break;
      case 3: pdp_accumulate<R, 3>(p, ldp, t, D, npairs, o + c0); break;
      case 2: pdp_accumulate<R, 2>(p, ldp, t, D, npairs, o + c0); break;
      default: pdp_accumulate<R, 1>(p, ldp, t, D, npairs, o + c0); break;
    }
  }
}

// One item (it.head_begin: its kv head; rows it.row_begin .. it.row_end of request it.req).
TRILLM_PDP_TARGET void attend_item_paged_dp(const Problem& p, const Item& it) {
  const int D = p.head_dim;
  const int group = p.num_heads / p.num_kv_heads;
  const int kv_head = it.head_begin;
  const int M = (it.row_end - it.row_begin) * group;  // vector i: row row_begin + i / group
  const int q0 = p.query_start_loc[it.req];
  const int query_len = p.query_start_loc[it.req + 1] - q0;
  const int context = p.seq_lens[it.req] - query_len;
  const int key_end = context + it.row_end;  // keys the item's last row sees
  const int stride = (key_end + kPdpKeys - 1) / kPdpKeys * kPdpKeys;  // whole tiles
  const int32_t* blocks = p.block_table + static_cast<int64_t>(it.req) * p.block_table_stride;
  const Bf16* kc = static_cast<const Bf16*>(p.k_cache);
  const Bf16* vc = static_cast<const Bf16*>(p.v_cache);
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t head_off = static_cast<int64_t>(kv_head) * D;

  alignas(64) static thread_local uint16_t qs[kPdpMaxVectors * kPdpMaxHeadDim];  // [M][D]
  alignas(64) static thread_local float acc[kPdpMaxVectors * kPdpMaxHeadDim];    // [M][D]
  alignas(64) static thread_local uint32_t kp[kPdpKeys / 2 * kPdpMaxHeadDim];    // K pairs
  alignas(64) static thread_local uint16_t vp[kPdpKeys * kPdpMaxHeadDim];        // V pairs
  static thread_local std::vector<uint16_t> pb_all;  // [M][stride]: P in bf16
  float* S = score_rows(M, stride);                  // [M][stride]: S, then P
  if (pb_all.size() < static_cast<size_t>(M) * stride)
    pb_all.resize(static_cast<size_t>(M) * stride);
  uint16_t* P = pb_all.data();
  int pos[kPdpMaxVectors];  // the key position of vector i's row

  const Bf16* q = static_cast<const Bf16*>(p.q);
  for (int i = 0; i < M; ++i) {
    const int row = it.row_begin + i / group;
    pos[i] = context + row;
    const int head = kv_head * group + i % group;
    const Bf16* src = q + (q0 + row) * p.q_token_stride + head * p.q_head_stride;
    std::memcpy(qs + i * D, src, D * sizeof(uint16_t));
    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(acc + i * D + d, _mm512_setzero_ps());
  }
  // This kv head's rows of keys key0 .. key0 + n in the cache `base`.
  const Bf16* rows[kPdpKeys];
  auto gather = [&](const Bf16* base, int key0, int n) {
    int b = key0 / p.block_size, o = key0 % p.block_size;
    for (int t = 0; t < n; ++t) {
      rows[t] = base + (static_cast<int64_t>(blocks[b]) * p.block_size + o) * slot_elems + head_off;
      if (++o == p.block_size) o = 0, ++b;
    }
  };

  // (1) S = Q . K^T over the keys some vector of a block sees.
  for (int key0 = 0; key0 < key_end; key0 += kPdpKeys) {
    const int n = std::min(kPdpKeys, key_end - key0);
    gather(kc, key0, n);
    pdp_pack_keys(rows, n, D, kp);
    for (int i = 0; i < M; i += kPdpRows) {
      const int nrows = std::min(kPdpRows, M - i);
      const int seen = std::min(n, pos[i + nrows - 1] - key0 + 1);
      if (seen <= 0) continue;
      float* s = S + static_cast<int64_t>(i) * stride + key0;
      const uint16_t* qi = qs + i * D;
      switch (nrows) {  // (no generic lambda: it would not carry this function's target)
        case 6: pdp_scores<6>(qi, D, kp, s, stride, seen); break;
        case 5: pdp_scores<5>(qi, D, kp, s, stride, seen); break;
        case 4: pdp_scores<4>(qi, D, kp, s, stride, seen); break;
        case 3: pdp_scores<3>(qi, D, kp, s, stride, seen); break;
        case 2: pdp_scores<2>(qi, D, kp, s, stride, seen); break;
        default: pdp_scores<1>(qi, D, kp, s, stride, seen); break;
      }
    }
  }
  // (2) Per row: the scores' roundings, the rounded softmax, then its bf16 copy (exact), zero
  // past the row's position up to the next tile's end (a block's later vectors read those).
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
    const int end = std::min(stride, (n + kPdpKeys - 1) / kPdpKeys * kPdpKeys + kPdpKeys);
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
    for (; c < end; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + c), _mm256_setzero_si256());
  }
  // (3) O = P . V over the keys the block's last vector sees (pairs: an odd count's partner key
  // has p = 0 for every row of the block and a zero value).
  for (int key0 = 0; key0 < key_end; key0 += kPdpKeys) {
    const int n = std::min(kPdpKeys, key_end - key0);
    gather(vc, key0, n);
    pdp_pack_values(rows, n, D, vp);
    for (int i = 0; i < M; i += kPdpRows) {
      const int nrows = std::min(kPdpRows, M - i);
      const int keys = std::min(n, pos[i + nrows - 1] - key0 + 1);
      if (keys <= 0) continue;
      const uint16_t* pi = P + static_cast<int64_t>(i) * stride + key0;
      const int pairs = (keys + 1) / 2;
      float* o = acc + i * D;
      switch (nrows) {
        case 6: pdp_accumulate_cols<6>(pi, stride, vp, D, pairs, o); break;
        case 5: pdp_accumulate_cols<5>(pi, stride, vp, D, pairs, o); break;
        case 4: pdp_accumulate_cols<4>(pi, stride, vp, D, pairs, o); break;
        case 3: pdp_accumulate_cols<3>(pi, stride, vp, D, pairs, o); break;
        case 2: pdp_accumulate_cols<2>(pi, stride, vp, D, pairs, o); break;
        default: pdp_accumulate_cols<1>(pi, stride, vp, D, pairs, o); break;
      }
    }
  }

  Bf16* out = static_cast<Bf16*>(p.out);
  for (int i = 0; i < M; ++i) {
    const int row = it.row_begin + i / group;
    const int head = kv_head * group + i % group;
    Bf16* dst = out + (q0 + row) * p.out_token_stride + head * p.out_head_stride;
    for (int d = 0; d < D; ++d) store(dst + d, acc[i * D + d]);
  }
}
