// The AVX2 / FMA / F16C path of ext/cpu_gemm_q.cpp, for CPUs without AVX-512 (chosen at run
// time); included there, inside its anonymous namespace, after the AVX-512 `tile`. Same packed
// layout, same work items, fp32 activations only (int8 activations stay AVX512-VNNI's).
//
// Every type's value is w = a q + b per column over a block (or half block) of k, q the raw
// integer of the packed record: a = d, b = -8 d (Q4_0), m (Q4_1), -d z (Q4_G), 0 (Q8_0);
// a = d sc, b = -dmin mn (Q4_K, and Q4_KM / Q5_KM per half block); a = d sc, b = 0 (Q6_K per
// half block). Both a q and the products in a and b are exact in fp32 (fp16 d times a 4- to
// 8-bit integer, times q below 2^5 but for Q6_K, whose a q rounds as q_panels.unpack's does),
// so one fused multiply-add gives q_panels.unpack's value, bit for bit.
//
// Two ways through a (row block, panel pair) work item:
// - a row block of fewer than kDirectRows rows (decode): per row, per block of 32 k, the sums
//   s = sum_k x[k] q[k] for 32 columns, in even / odd k chains, from the packed integers in
//   registers; then acc += a s + b sx (sx the block's, or half block's, sum of x), as the
//   AVX-512 tile does. Memory-bound: the weight is read once per row, 4.5-9 bits a value.
// - more rows: each panel's weights are dequantized, kChunk k at a time, into an fp32 buffer
//   that stays in L1 (w = a q + b, the values above), and a 6-row x 16-column register tile runs
//   over it, its sums kept per row block in `acc` between chunks. The products are then those
//   of F.linear on the dequantized weight, summed over k in order, one chain per output.
// Both orders are fixed per output, so results do not depend on the thread count.

#define TRILLM_Q_AVX2 __attribute__((target("avx2,fma,f16c")))

constexpr int kDirectRows = 2;  // row blocks with fewer rows take the direct path
constexpr int kChunk = 128;     // k dequantized at a time: 128 x 16 fp32, 8 KiB of L1
constexpr int kTileRows = 6;    // rows of the dequantized path's register tile: 12 accumulators

bool cpu_has_avx2_f16c() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

TRILLM_Q_AVX2 inline __m256 fp16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

TRILLM_Q_AVX2 inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

TRILLM_Q_AVX2 inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// w = a q + b for columns 8h .. 8h + 7 of a record (`params` its d[16] and what follows).
struct Affine {
  __m256 a, b;
};

// The record's a and b for columns 8h .. 8h + 7: over the block, or (Q6_K, Q4_KM, Q5_KM) over
// its half block `half`; the offsets are the record layout's (cpu_gemm_q.cpp's comment).
template <int QT>
TRILLM_Q_AVX2 inline Affine affine(const uint8_t* params, int h, int half) {
  const __m256 d = fp16x8(params + 16 * h);
  const __m256 zero = _mm256_setzero_ps();
  if constexpr (QT == kQ4_0) return {d, _mm256_mul_ps(d, _mm256_set1_ps(-8.0f))};
  if constexpr (QT == kQ4_1) return {d, fp16x8(params + 2 * kCols + 16 * h)};
  if constexpr (QT == kQ4_G) {
    const __m256 z = u8x8(params + 2 * kCols + 8 * h);
    return {d, _mm256_sub_ps(zero, _mm256_mul_ps(d, z))};
  }
  if constexpr (QT == kQ6_K) return {_mm256_mul_ps(d, i8x8(params + (2 + half) * kCols + 8 * h)), zero};
  if constexpr (QT == kQ4_K || half_min(QT)) {
    const __m256 dmin = fp16x8(params + 2 * kCols + 16 * h);
    const int sc_at = QT == kQ4_K ? 4 * kCols : (4 + half) * kCols;
    const int mn_at = QT == kQ4_K ? 5 * kCols : (6 + half) * kCols;
    const __m256 sc = QT == kQ4_K ? u8x8(params + sc_at + 8 * h) : i8x8(params + sc_at + 8 * h);
    const __m256 mn = QT == kQ4_K ? u8x8(params + mn_at + 8 * h) : i8x8(params + mn_at + 8 * h);
    return {_mm256_mul_ps(d, sc), _mm256_sub_ps(zero, _mm256_mul_ps(dmin, mn))};
  }
  return {d, zero};  // Q8_0
}

// q[i] = the integers of columns 8h .. 8h + 7 at k = 4 j4 + i of a record, as fp32.
template <int QT>
TRILLM_Q_AVX2 inline void values4(const uint8_t* rec, int h, int j4, __m256 (&q)[4]) {
  if constexpr (byte_values(QT)) {  // one 32-bit lane a column, its four k's int8 in the bytes
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + j4 * 4 * kCols + 32 * h));
    q[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
    q[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
    q[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24));
    q[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
  } else {  // nibble pairs j = 2 j4, 2 j4 + 1: the low nibble k = 2j, the high one 2j + 1
    const __m256i low4 = _mm256_set1_epi32(0xf);
    __m256i n[4];
    for (int p = 0; p < 2; ++p) {
      const uint8_t* at = rec + (2 * j4 + p) * kCols + 8 * h;
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
      n[2 * p] = _mm256_and_si256(v, low4);
      n[2 * p + 1] = _mm256_srli_epi32(v, 4);
    }
    if constexpr (QT == kQ5_KM) {  // bit 4c + i of hb[j4] (its 32-bit half h) is q[c][4 j4 + i]'s 16
      uint32_t word;
      std::memcpy(&word, rec + kBlock / 2 * kCols + 8 * j4 + 4 * h, 4);
      const __m256i bits = _mm256_set1_epi32(static_cast<int>(word));
      const __m256i at = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
      const __m256i one = _mm256_set1_epi32(1);
      for (int i = 0; i < 4; ++i) {
        const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(at, _mm256_set1_epi32(i))), one);
        n[i] = _mm256_or_si256(n[i], _mm256_slli_epi32(bit, 4));
      }
    }
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtepi32_ps(n[i]);
  }
}

// y[m, col .. col + cols) = acc (+ bias), fp32 or bf16; acc the row's sums, columns past N dropped.
void store_row_avx2(const Gemm& g, int m, int col, int cols, const float* acc) {
  cols = std::min(cols, g.N - col);
  char* row = static_cast<char*>(g.y) + (m * g.ldy + col) * (g.y_bf16 ? 2 : 4);
  for (int c = 0; c < cols; ++c) {
    const float v = acc[c] + (g.bias != nullptr ? g.bias[col + c] : 0.0f);
    if (g.y_bf16)
      reinterpret_cast<uint16_t*>(row)[c] = to_bf16(v);
    else
      reinterpret_cast<float*>(row)[c] = v;
  }
}

// ---- the direct path: one row x one panel pair, integers in registers

// acc + a s + b sx over one (half) block, for the pair's four column vectors.
template <int QT>
TRILLM_Q_AVX2 inline void fold(__m256 (&acc)[4], __m256 (&se)[4], __m256 (&so)[4],
                               const uint8_t* const (&params)[2], int half, float sx) {
  for (int v = 0; v < 4; ++v) {
    const Affine f = affine<QT>(params[v / 2], v % 2, half);
    acc[v] = _mm256_fmadd_ps(f.a, _mm256_add_ps(se[v], so[v]), acc[v]);
    if constexpr (!byte_values(QT)) acc[v] = _mm256_fmadd_ps(f.b, _mm256_set1_ps(sx), acc[v]);
    se[v] = so[v] = _mm256_setzero_ps();
  }
}

template <int QT>
TRILLM_Q_AVX2 void row_direct(const Gemm& g, int m, const uint8_t* p0, const uint8_t* p1, int col) {
  constexpr int qbytes = quant_bytes(QT), rec = qbytes + param_bytes(QT);
  const int nb = g.K / kBlock;
  const float* x = g.x + m * g.ldx;
  const uint8_t* panel[2] = {p0, p1};
  __m256 acc[4], se[4], so[4];
  for (int v = 0; v < 4; ++v) acc[v] = se[v] = so[v] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    prefetch_gemv_records(panel, b, nb, rec);  // ext/cpu_gemm_q.cpp
    const uint8_t* recs[2] = {panel[0] + static_cast<int64_t>(b) * rec, panel[1] + static_cast<int64_t>(b) * rec};
    const uint8_t* const params[2] = {recs[0] + qbytes, recs[1] + qbytes};
    const float* xb = x + b * kBlock;
    for (int j4 = 0; j4 < kBlock / 4; ++j4) {
      if (half_scales(QT) && j4 == kBlock / 8)  // the first half block has its own scale
        fold<QT>(acc, se, so, params, 0, half_min(QT) ? g.sx[m * 2 * nb + 2 * b] : 0.0f);
      __m256 xk[4];
      for (int i = 0; i < 4; ++i) xk[i] = _mm256_broadcast_ss(xb + 4 * j4 + i);
      for (int v = 0; v < 4; ++v) {
        __m256 q[4];
        values4<QT>(recs[v / 2], v % 2, j4, q);
        se[v] = _mm256_fmadd_ps(xk[0], q[0], se[v]);
        so[v] = _mm256_fmadd_ps(xk[1], q[1], so[v]);
        se[v] = _mm256_fmadd_ps(xk[2], q[2], se[v]);
        so[v] = _mm256_fmadd_ps(xk[3], q[3], so[v]);
      }
    }
    const float sx = half_min(QT)      ? g.sx[m * 2 * nb + 2 * b + 1]
                     : byte_values(QT) ? 0.0f
                                       : g.sx[m * nb + b];
    fold<QT>(acc, se, so, params, 1, sx);
  }
  alignas(32) float out[4 * 8];
  for (int v = 0; v < 4; ++v) _mm256_store_ps(out + 8 * v, acc[v]);
  store_row_avx2(g, m, col, 2 * kCols, out);
}

// ---- the dequantized path: a panel's fp32 values kChunk k at a time, a 6 x 16 register tile

// w[k][16] (k < 32) = the record's values of its 16 columns, w = a q + b.
template <int QT>
TRILLM_Q_AVX2 void dequantize_record(const uint8_t* rec, float* w) {
  const uint8_t* params = rec + quant_bytes(QT);
  for (int h = 0; h < 2; ++h) {
    Affine f = affine<QT>(params, h, 0);
    for (int j4 = 0; j4 < kBlock / 4; ++j4) {
      if (half_scales(QT) && j4 == kBlock / 8) f = affine<QT>(params, h, 1);
      __m256 q[4];
      values4<QT>(rec, h, j4, q);
      for (int i = 0; i < 4; ++i)
        _mm256_store_ps(w + (4 * j4 + i) * kCols + 8 * h, _mm256_fmadd_ps(f.a, q[i], f.b));
    }
  }
}

// acc[R][16] (+)= x[m .. m + R, k0 .. k0 + kn) . w[kn][16]; `first`: acc starts at zero.
template <int R>
TRILLM_Q_AVX2 void tile_dequantized(const Gemm& g, int m, int k0, int kn, const float* w,
                                    float* acc, bool first) {
  __m256 c0[R], c1[R];  // columns 0..7 and 8..15 of each row
  const float* x = g.x + m * g.ldx + k0;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    c0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kCols);
    c1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kCols + 8);
  }
  for (int k = 0; k < kn; ++k) {
    const __m256 w0 = _mm256_load_ps(w + k * kCols), w1 = _mm256_load_ps(w + k * kCols + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * g.ldx + k);
      c0[r] = _mm256_fmadd_ps(xr, w0, c0[r]);
      c1[r] = _mm256_fmadd_ps(xr, w1, c1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * kCols, c0[r]);
    _mm256_storeu_ps(acc + r * kCols + 8, c1[r]);
  }
}

template <int R>
TRILLM_Q_AVX2 void tiles_dequantized(const Gemm& g, int m0, int m1, int k0, int kn, const float* w, float* acc) {
  for (int m = m0; m + R <= m1; m += R)
    tile_dequantized<R>(g, m, k0, kn, w, acc + (m - m0) * kCols, k0 == 0);
}

template <int QT>
TRILLM_Q_AVX2 void panel_dequantized(const Gemm& g, int m0, int m1, const uint8_t* panel, int col) {
  constexpr int rec = quant_bytes(QT) + param_bytes(QT);
  alignas(32) float w[kChunk * kCols];
  alignas(32) float acc[kRowBlock * kCols];  // the row block's sums, [rows][16]
  const int rows = m1 - m0, tail = rows % kTileRows, m_tail = m1 - tail;
  for (int k0 = 0; k0 < g.K; k0 += kChunk) {
    const int kn = std::min(kChunk, g.K - k0);
    for (int b = 0; b < kn / kBlock; ++b)
      dequantize_record<QT>(panel + static_cast<int64_t>(k0 / kBlock + b) * rec, w + b * kBlock * kCols);
    tiles_dequantized<kTileRows>(g, m0, m_tail, k0, kn, w, acc);
    float* acc_tail = acc + (m_tail - m0) * kCols;
    switch (tail) {
      case 1: tiles_dequantized<1>(g, m_tail, m1, k0, kn, w, acc_tail); break;
      case 2: tiles_dequantized<2>(g, m_tail, m1, k0, kn, w, acc_tail); break;
      case 3: tiles_dequantized<3>(g, m_tail, m1, k0, kn, w, acc_tail); break;
      case 4: tiles_dequantized<4>(g, m_tail, m1, k0, kn, w, acc_tail); break;
      case 5: tiles_dequantized<5>(g, m_tail, m1, k0, kn, w, acc_tail); break;
      default: break;
    }
  }
  for (int m = m0; m < m1; ++m) store_row_avx2(g, m, col, kCols, acc + (m - m0) * kCols);
}

template <int QT>
void rows_for_pair_avx2(const Gemm& g, int m0, int m1, int pair) {
  const int64_t panel_bytes = static_cast<int64_t>(g.K / kBlock) * record_bytes(QT);
  const uint8_t* p0 = g.packed + 2 * pair * panel_bytes;
  const int col = 2 * pair * kCols;
  if (m1 - m0 < kDirectRows) {
    for (int m = m0; m < m1; ++m) row_direct<QT>(g, m, p0, p0 + panel_bytes, col);
    return;
  }
  panel_dequantized<QT>(g, m0, m1, p0, col);
  if (col + kCols < g.N) panel_dequantized<QT>(g, m0, m1, p0 + panel_bytes, col + kCols);
}

void run_pair_avx2(const Gemm& g, int m0, int m1, int pair) {
  switch (g.qtype) {
    case kQ4_0: rows_for_pair_avx2<kQ4_0>(g, m0, m1, pair); break;
    case kQ4_1: rows_for_pair_avx2<kQ4_1>(g, m0, m1, pair); break;
    case kQ4_G: rows_for_pair_avx2<kQ4_G>(g, m0, m1, pair); break;
    case kQ4_K: rows_for_pair_avx2<kQ4_K>(g, m0, m1, pair); break;
    case kQ6_K: rows_for_pair_avx2<kQ6_K>(g, m0, m1, pair); break;
    case kQ5_KM: rows_for_pair_avx2<kQ5_KM>(g, m0, m1, pair); break;
    case kQ4_KM: rows_for_pair_avx2<kQ4_KM>(g, m0, m1, pair); break;
    default: rows_for_pair_avx2<kQ8_0>(g, m0, m1, pair); break;
  }
}
