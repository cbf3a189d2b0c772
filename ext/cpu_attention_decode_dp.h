// The paged kernel's decode rows (one query row per item) for bf16 q and a bf16 cache on CPUs
// with AVX512-BF16. Included by ext/cpu_attention.cpp inside its anonymous namespace, after
// Problem, Item, the bf16 rounding points and ext/cpu_attention_dp_tiles.h (TRILLM_DOT_TARGET).
//
// Why: the one-row kernel (ext/cpu_attention_decode.h) widens every bf16 key and value to fp32
// once per query vector of its GQA group and reduces each score across lanes on its own; at
// Llama-3.2-1B's shape (32 query / 8 kv heads of 64, 16 layers, 1,024 keys, one thread) a
// batch-1 step's attention took 13.1 ms of CPU (2.6 GB/s of K/V); this kernel 5.6-6.0 ms, and
// 0.16 against 0.55 ms a layer with the layer's K/V in cache (alternated in one process).
// Here, per kv head: (1) scores, 16 keys at a time: each key row's bf16 pairs go straight into
// vdpbf16ps against each query vector of the group (fp32 sums of pairs, a 16-key transposing add
// tree: one zmm of 16 scores), the row loaded from memory once for the whole group; (2) the same
// rounding points as the other bf16 kernels (round_scores, the soft cap, rounded_softmax_row:
// transformers' bf16 eager attention); (3) acc += p_t v_t in fp32, each value row widened once
// for a block of query vectors. Keys are walked block by block (no division per key); a
// window's earlier keys are neither read nor scored.
#pragma once

constexpr int kDdKeys = 16;  // keys per score tile

// {sum of the 16 lanes of a[t]}_{t < 16}, in key order: unpacks within 128-bit lanes, then
// swaps of 128-bit lanes (30 shuffles, 15 adds).
TRILLM_DOT_TARGET inline __attribute__((always_inline)) __m512 dd_sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Each lane rounded to bf16 (nearest even) and widened back: round_bf16 on 16 lanes.
TRILLM_DOT_TARGET inline __attribute__((always_inline)) __m512 dd_round_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_castsi512_ps(
      _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// s[0 .. 16) = the two-rounded scores of one query vector (KC zmm of bf16 pairs) against keys
// rows[0 .. 16).
template <int KC>
TRILLM_DOT_TARGET inline __attribute__((always_inline)) void dd_scores16(
    const __m512bh* q, const uint16_t* const* rows, __m512 scale, float* s) {
  __m512 a[kDdKeys];
  for (int t = 0; t < kDdKeys; ++t) {
    __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0],
                                (__m512bh)_mm512_loadu_si512(rows[t]));
    for (int c = 1; c < KC; ++c)
      x = _mm512_dpbf16_ps(x, q[c], (__m512bh)_mm512_loadu_si512(rows[t] + 32 * c));
    a[t] = x;
  }
  const __m512 sums = dd_sum16(a);
  // round_scores on 16 lanes: the matmul's bf16 store, times the scale, rounded again.
  _mm512_storeu_ps(s, dd_round_bf16(_mm512_mul_ps(dd_round_bf16(sums), scale)));
}

// acc[i][0 .. 16 NZ) += sum over keys of p[i][t] * v_t for R query vectors (p rows of lds
// floats, the n value rows at rows[t]); each value row widened once for all R vectors.
template <int NZ, int R>
TRILLM_DOT_TARGET inline __attribute__((always_inline)) void dd_accumulate(
    const float* p, int64_t lds, const uint16_t* const* rows, int n, float* acc) {
  __m512 o[R][NZ];
  for (int i = 0; i < R; ++i)
    for (int z = 0; z < NZ; ++z) o[i][z] = _mm512_loadu_ps(acc + (i * NZ + z) * 16);
  for (int t = 0; t < n; ++t) {
    __m512 v[NZ];
    for (int z = 0; z < NZ; ++z)
      v[z] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(rows[t] + 16 * z))), 16));
    for (int i = 0; i < R; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * lds + t]);
      for (int z = 0; z < NZ; ++z) o[i][z] = _mm512_fmadd_ps(w, v[z], o[i][z]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(acc + (i * NZ + z) * 16, o[i][z]);
}

// p rows [G][lds] -> acc [G][16 NZ] over n keys, query vectors in blocks of up to 16 / NZ.
template <int NZ>
TRILLM_DOT_TARGET inline void dd_accumulate_group(const float* p, int64_t lds, int G,
                                                  const uint16_t* const* rows, int n,
                                                  float* acc) {
  constexpr int kBlock = 16 / NZ;  // 4 vectors of 64, 2 of 128: 16 zmm of sums
  for (int i = 0; i < G; i += kBlock) {
    const float* pi = p + i * lds;
    float* ai = acc + i * NZ * 16;
    switch (std::min(kBlock, G - i)) {
      case 4: dd_accumulate<NZ, (kBlock >= 4 ? 4 : 1)>(pi, lds, rows, n, ai); break;
      case 3: dd_accumulate<NZ, (kBlock >= 3 ? 3 : 1)>(pi, lds, rows, n, ai); break;
      case 2: dd_accumulate<NZ, 2>(pi, lds, rows, n, ai); break;
      default: dd_accumulate<NZ, 1>(pi, lds, rows, n, ai); break;
    }
  }
}

// One decode item (one query row; kv heads it.head_begin .. it.head_end), head_dim 64 or 128.
template <int D>
TRILLM_DOT_TARGET void attend_decode_dp_d(const Problem& p, const Item& it) {
  constexpr int KC = D / 32;  // zmm of bf16 pairs a key row
  constexpr int NZ = D / 16;  // zmm of fp32 a value row
  const int group = p.num_heads / p.num_kv_heads;
  const int q0 = p.query_start_loc[it.req];
  const int query_len = p.query_start_loc[it.req + 1] - q0;
  const int key_end = p.seq_lens[it.req] - query_len + it.row_begin + 1;
  const int key_begin = p.window > 0 ? std::max(0, key_end - p.window) : 0;
  const int n = key_end - key_begin;  // >= 1
  const int stride = (n + kDdKeys - 1) / kDdKeys * kDdKeys;
  const int32_t* blocks = p.block_table + static_cast<int64_t>(it.req) * p.block_table_stride;
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t token = q0 + it.row_begin;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q) + token * p.q_token_stride;
  Bf16* out = static_cast<Bf16*>(p.out) + token * p.out_token_stride;
  float* S = score_rows(group, stride);  // [group][stride], scores then probabilities
  static thread_local std::vector<const uint16_t*> rows_buf;
  static thread_local std::vector<float> acc_buf;
  if (rows_buf.size() < static_cast<size_t>(stride)) rows_buf.resize(stride);
  if (acc_buf.size() < static_cast<size_t>(group) * D) acc_buf.resize(group * D);
  const uint16_t** rows = rows_buf.data();
  float* A = acc_buf.data();  // [group][D]
  const __m512 scale = _mm512_set1_ps(p.scale);

  // rows[u] = kv head h's row of key key_begin + u in `cache`; past n the last one again.
  auto fill_rows = [&](const void* cache, int h) {
    const uint16_t* base = static_cast<const uint16_t*>(cache) + h * D;
    int b = key_begin / p.block_size, o = key_begin % p.block_size;
    const uint16_t* r = base + (static_cast<int64_t>(blocks[b]) * p.block_size + o) * slot_elems;
    for (int u = 0; u < n; ++u) {
      rows[u] = r;
      if (++o < p.block_size) {
        r += slot_elems;
      } else if (u + 1 < n) {
        o = 0;
        r = base + static_cast<int64_t>(blocks[++b]) * p.block_size * slot_elems;
      }
    }
    for (int u = n; u < stride; ++u) rows[u] = rows[n - 1];
  };

  for (int h = it.head_begin; h < it.head_end; ++h) {
    // (1) Scores, 16 keys at a time for each query vector of the group (the tile's rows stay
    // in L1 across the group; the next tile's are fetched during the first vector's).
    fill_rows(p.k_cache, h);
    for (int t0 = 0; t0 < n; t0 += kDdKeys) {
      if (t0 + kDdKeys < n) {
        for (int t = t0 + kDdKeys; t < t0 + 2 * kDdKeys; ++t)
          for (int c = 0; c < D * 2; c += 64)
            _mm_prefetch(reinterpret_cast<const char*>(rows[t]) + c, _MM_HINT_T0);
      }
      for (int g = 0; g < group; ++g) {
        const uint16_t* qg = q + static_cast<int64_t>(h * group + g) * p.q_head_stride;
        __m512bh qv[KC];
        for (int c = 0; c < KC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
        dd_scores16<KC>(qv, rows + t0, scale, S + static_cast<int64_t>(g) * stride + t0);
      }
    }
    // (2) The soft cap and the rounded softmax (transformers' bf16 eager attention).
    for (int g = 0; g < group; ++g) {
      float* s = S + static_cast<int64_t>(g) * stride;
      if (p.softcap > 0.0f) soft_cap(s, n, p.softcap);
      rounded_softmax_row(s, n);
    }
    // (3) acc = P @ V in fp32, rounded once at the store.
    fill_rows(p.v_cache, h);
    for (int i = 0; i < group * D; i += 16) _mm512_storeu_ps(A + i, _mm512_setzero_ps());
    dd_accumulate_group<NZ>(S, stride, group, rows, n, A);
    for (int g = 0; g < group; ++g) {
      Bf16* dst = out + static_cast<int64_t>(h * group + g) * p.out_head_stride;
      for (int d = 0; d < D; ++d) store(dst + d, A[g * D + d]);
    }
  }
}

inline bool decode_dp_layout(int head_dim) { return head_dim == 64 || head_dim == 128; }

TRILLM_DOT_TARGET void attend_decode_dp(const Problem& p, const Item& it) {
  if (p.head_dim == 64) attend_decode_dp_d<64>(p, it);
  else attend_decode_dp_d<128>(p, it);
}
