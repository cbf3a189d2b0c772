// The bf16 decode rows on AVX512-BF16 with each cache slot read once for all the kv heads of an
// item ("bf16-dot"). Included by ext/cpu_attention.cpp after ext/cpu_attention_decode_dp.h
// (dd_sum16, dd_round_bf16: the same scores, softmax and P @ V, in the same order: the same
// bits as attend_decode_dp, kept as "bf16-dot-per-head" for tests and benchmarks).
//
// Why: attend_decode_dp walks the keys once per kv head, reading that head's 2 of the 6 cache
// lines of every slot at SmolLM2-135M's shape (3 kv heads of 64), and prefetched only the keys;
// the hardware prefetcher follows neither, and at batch 16 over ~300 keys (the K / V out of
// cache) it read 4.2 GB/s against 13.8 with the same K / V in cache. Here the keys are walked
// once for up to kDsBudget bytes of score rows' worth of kv heads (all of them below a few
// thousand keys): each slot's rows of those heads, one contiguous run, are scored for every
// query vector of their groups, and the next tile's runs (keys, then values) are prefetched a
// tile ahead; the value pass walks the slots in the same order, a tile of keys per head.
#pragma once

constexpr int kDsKeys = 32;                     // keys of a value-pass tile (2 score tiles)
constexpr int64_t kDsBudget = int64_t{1} << 18;  // bytes of score rows at once (per thread)

// The 64-byte lines [p, p + bytes) fetched towards L2 (prefetcht2: on this host the same walk
// with prefetcht0 held the L1's miss buffers and ran at half the rate, no faster than none).
inline __attribute__((always_inline)) void ds_prefetch(const void* p, int bytes) {
  const char* c = static_cast<const char*>(p);
  for (int i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T2);
}

// As dd_scores16 with key row t at base + off[t].
template <int KC>
TRILLM_DOT_TARGET inline __attribute__((always_inline)) void ds_scores16(
    const __m512bh* q, const uint16_t* base, const int64_t* off, __m512 scale, float* s) {
  __m512 a[kDdKeys];
  for (int t = 0; t < kDdKeys; ++t) {
    const uint16_t* r = base + off[t];
    __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(r));
    for (int c = 1; c < KC; ++c)
      x = _mm512_dpbf16_ps(x, q[c], (__m512bh)_mm512_loadu_si512(r + 32 * c));
    a[t] = x;
  }
  const __m512 sums = dd_sum16(a);
  _mm512_storeu_ps(s, dd_round_bf16(_mm512_mul_ps(dd_round_bf16(sums), scale)));
}

// As dd_accumulate with value row t at base + off[t], acc in the pair order: zmm 2c holds the
// even dims of the row's c-th 32 (32 c + 2 l in lane l), zmm 2c + 1 the odd ones. Each loaded
// zmm of 32 bf16 widens in two ops (a shift, a mask) where cvtepu16 + shift take two per 16;
// every dim's sums are the same FMAs in the same key order, so the same bits.
template <int NZ, int R>
TRILLM_DOT_TARGET inline __attribute__((always_inline)) void ds_accumulate(
    const float* p, int64_t lds, const uint16_t* base, const int64_t* off, int n, float* acc) {
  __m512 o[R][NZ];
  for (int i = 0; i < R; ++i)
    for (int z = 0; z < NZ; ++z) o[i][z] = _mm512_loadu_ps(acc + (i * NZ + z) * 16);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int t = 0; t < n; ++t) {
    const uint16_t* r = base + off[t];
    __m512 v[NZ];
    for (int c = 0; c < NZ / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(r + 32 * c);
      v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
    }
    for (int i = 0; i < R; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * lds + t]);
      for (int z = 0; z < NZ; ++z) o[i][z] = _mm512_fmadd_ps(w, v[z], o[i][z]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(acc + (i * NZ + z) * 16, o[i][z]);
}

// As dd_accumulate_group: p rows [G][lds] -> acc [G][16 NZ] over n keys.
template <int NZ>
TRILLM_DOT_TARGET inline void ds_accumulate_group(const float* p, int64_t lds, int G,
                                                  const uint16_t* base, const int64_t* off,
                                                  int n, float* acc) {
  constexpr int kBlock = 16 / NZ;
  for (int i = 0; i < G; i += kBlock) {
    const float* pi = p + i * lds;
    float* ai = acc + i * NZ * 16;
    switch (std::min(kBlock, G - i)) {
      case 4: ds_accumulate<NZ, (kBlock >= 4 ? 4 : 1)>(pi, lds, base, off, n, ai); break;
      case 3: ds_accumulate<NZ, (kBlock >= 3 ? 3 : 1)>(pi, lds, base, off, n, ai); break;
      case 2: ds_accumulate<NZ, 2>(pi, lds, base, off, n, ai); break;
      default: ds_accumulate<NZ, 1>(pi, lds, base, off, n, ai); break;
    }
  }
}

// One decode item (one query row; kv heads it.head_begin .. it.head_end), head_dim 64 or 128.
template <int D>
TRILLM_DOT_TARGET void attend_decode_ds_d(const Problem& p, const Item& it) {
  constexpr int KC = D / 32, NZ = D / 16;
  const int group = p.num_heads / p.num_kv_heads;
  const int q0 = p.query_start_loc[it.req];
  const int query_len = p.query_start_loc[it.req + 1] - q0;
  const int key_end = p.seq_lens[it.req] - query_len + it.row_begin + 1;
  const int key_begin = p.window > 0 ? std::max(0, key_end - p.window) : 0;
  const int n = key_end - key_begin;  // >= 1
  const int stride = (n + kDsKeys - 1) / kDsKeys * kDsKeys;
  const int32_t* blocks = p.block_table + static_cast<int64_t>(it.req) * p.block_table_stride;
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t token = q0 + it.row_begin;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q) + token * p.q_token_stride;
  Bf16* out = static_cast<Bf16*>(p.out) + token * p.out_token_stride;
  const uint16_t* kc = static_cast<const uint16_t*>(p.k_cache);
  const uint16_t* vc = static_cast<const uint16_t*>(p.v_cache);
  // kv heads at once: their score rows within kDsBudget bytes, at least one
  const int per_head = static_cast<int>(std::max<int64_t>(
      1, kDsBudget / (static_cast<int64_t>(group) * stride * static_cast<int64_t>(sizeof(float)))));
  const int heads_at_once = std::min(it.head_end - it.head_begin, per_head);
  float* S = score_rows(heads_at_once * group, stride);  // [vector][stride]
  static thread_local std::vector<int64_t> off_buf;
  static thread_local std::vector<float> acc_buf;
  if (off_buf.size() < static_cast<size_t>(stride)) off_buf.resize(stride);
  if (acc_buf.size() < static_cast<size_t>(heads_at_once) * group * D)
    acc_buf.resize(static_cast<size_t>(heads_at_once) * group * D);
  int64_t* off = off_buf.data();  // key key_begin + u's slot, in elements; past n the last again
  float* A = acc_buf.data();      // [vector][D], each row in ds_accumulate's pair order
  {
    int b = key_begin / p.block_size, o = key_begin % p.block_size;
    int64_t r = (static_cast<int64_t>(blocks[b]) * p.block_size + o) * slot_elems;
    for (int u = 0; u < n; ++u) {
      off[u] = r;
      if (++o < p.block_size) {
        r += slot_elems;
      } else if (u + 1 < n) {
        o = 0;
        r = static_cast<int64_t>(blocks[++b]) * p.block_size * slot_elems;
      }
    }
    for (int u = n; u < stride; ++u) off[u] = off[n - 1];
  }
  const __m512 scale = _mm512_set1_ps(p.scale);

  for (int h0 = it.head_begin; h0 < it.head_end; h0 += heads_at_once) {
    const int hn = std::min(heads_at_once, it.head_end - h0);
    const int run = hn * D * 2;  // bytes of a slot's rows of heads h0 .. h0 + hn
    const uint16_t* kh = kc + h0 * D;
    const uint16_t* vh = vc + h0 * D;
    // (1) Scores, 16 keys at a time for every vector of heads h0 .. h0 + hn; the next 16
    // slots' runs prefetched.
    for (int t0 = 0; t0 < n; t0 += kDdKeys) {
      const int ahead = std::min(t0 + 2 * kDdKeys, n);
      for (int t = t0 + kDdKeys; t < ahead; ++t) ds_prefetch(kh + off[t], run);
      if (t0 + kDdKeys >= n) {  // the values' first tile, for the pass after the softmax
        for (int t = 0; t < std::min(kDsKeys, n); ++t) ds_prefetch(vh + off[t], run);
      }
      for (int j = 0; j < hn; ++j) {
        for (int g = 0; g < group; ++g) {
          const int v = j * group + g;
          const uint16_t* qg = q + static_cast<int64_t>((h0 + j) * group + g) * p.q_head_stride;
          __m512bh qv[KC];
          for (int c = 0; c < KC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
          float* s = S + static_cast<int64_t>(v) * stride + t0;
          ds_scores16<KC>(qv, kh + j * D, off + t0, scale, s);
        }
      }
    }
    // (2) The soft cap and the rounded softmax, per vector.
    for (int v = 0; v < hn * group; ++v) {
      float* s = S + static_cast<int64_t>(v) * stride;
      if (p.softcap > 0.0f) soft_cap(s, n, p.softcap);
      rounded_softmax_row(s, n);
    }
    // (3) acc = P @ V in fp32 (each vector's sums in key order, as attend_decode_dp), a tile
    // of kDsKeys slots at a time for every head; the next tile's runs prefetched.
    for (int i = 0; i < hn * group * D; i += 16) _mm512_storeu_ps(A + i, _mm512_setzero_ps());
    for (int t0 = 0; t0 < n; t0 += kDsKeys) {
      const int ahead = std::min(t0 + 2 * kDsKeys, n);
      for (int t = t0 + kDsKeys; t < ahead; ++t) ds_prefetch(vh + off[t], run);
      const int m = std::min(kDsKeys, n - t0);
      for (int j = 0; j < hn; ++j)
        ds_accumulate_group<NZ>(S + static_cast<int64_t>(j) * group * stride + t0, stride, group,
                                vh + j * D, off + t0, m, A + j * group * D);
    }
    for (int v = 0; v < hn * group; ++v) {
      Bf16* dst = out + static_cast<int64_t>(h0 * group + v) * p.out_head_stride;
      const float* a = A + v * D;  // in ds_accumulate's pair order
      for (int d = 0; d < D; ++d) store(dst + d, a[(d & ~31) + (d & 1) * 16 + ((d & 31) >> 1)]);
    }
  }
}

TRILLM_DOT_TARGET void attend_decode_ds(const Problem& p, const Item& it) {
  if (p.head_dim == 64) attend_decode_ds_d<64>(p, it);
  else attend_decode_ds_d<128>(p, it);
}
