// The int8-activation path of ext/cpu_gemm_q.cpp (Q4_0, Q4_1, Q4_G, Q4_K, Q4_KM, Q5_KM, Q8_0,
// Q6_K), on CPUs with AVX512-VNNI; included there, inside its anonymous namespace, after `tile`.
//
// Each row of x is rounded per half block of 16 to int8: dx = absmax / 127, xq = round(x / dx)
// (half to even, as torch.round; a half of zeros has dx 0). A half block's sum of x * q is then
// an integer dot product: `vpdpbusd` multiplies four unsigned weight bytes (0..15) by four
// signed activation bytes and adds the four products to an int32 lane, exact; s = dx_h0 * the
// first half's sum + dx_h1 * the second's, and sx = the same over sum(xq), so the result is
// exactly W . x^ (x^ = xq * dx, the rounded activations) up to the order of the fp32 additions
// (kernels/linear_q_cpu.py's `quantize_activations` is the reference). Its error against W . x
// is bounded by the rounding of x: |x - x^| <= dx / 2. Scales per 16 rather than per 32 (the
// weights' block, llama.cpp's choice): one large activation then coarsens 15 others, not 31.
// On SmolLM2 Q8_0 that cut int8's own perplexity cost (over fp32 activations) on a 2,721-token
// text from +0.54% to +0.12%, for one more int32 -> fp32 conversion per block and column
// (Q8_0's int8 GEMMs ~20% slower, Q4_1's 3-6%; benchmarks/archive/RESULTS-journal.md, section 21, addendum).
//
// The packed weight is the fp32 kernel's. Q4: byte [j][c] holds q[c][2j] and q[c][2j + 1]; two
// 16-byte loads (pairs j, j + 1), widened to 32-bit lanes and merged, put column c's
// q[2j .. 2j + 3] into the four bytes of lane c, the layout `vpdpbusd` wants, in five
// instructions for 16 columns and 4 k (Q5_KM: hb[j / 2] as a byte mask ORs the fifth bits in).
// Q8_0: that layout is the packed one, but its weights are
// signed and `vpdpbusd` takes unsigned bytes on that side: flipping the sign bit gives q + 128
// (0..255), whose dot product with xq is sum(q xq) + 128 sum(xq); each half block's integer sum
// of xq (`qxh`) takes the excess back out, exactly, before that half's conversion to fp32. Q6_K
// (q - 32 stored as Q8_0's bytes) does the same, each half also with its own weight scale. Q4_KM
// and Q5_KM (unsigned, no excess) fold each half with its own scale and minimum, the minimum
// times that half's sum of x^ (dx_h * its integer sum of xq, the term quantize_rows adds into sx).

#define TRILLM_VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

bool cpu_has_vnni() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// Rows of int8 activations: xq [M][K], dx [M][2 nb] the scale of each half block, sx [M][nb] =
// the block's sum of x^ (dx_h0 * sum(xq_h0) + dx_h1 * sum(xq_h1)), qxh [M][2 nb] the integer
// sums of xq over each half block.
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
  std::vector<int32_t> qxh;
};

// Rows [r0, r1) of x (fp32, or bf16 when x_bf16, widened exactly) -> out: per half block,
// dx = absmax / 127 and xq = round(x / dx) (an IEEE division, round half to even: torch's
// x / dx and torch.round), 0 where dx is 0; sx = dx_h0 * sum_h0, then + dx_h1 * sum_h1. A half
// block holding a NaN or an infinity gets dx NaN (xq and its sum 0): that row's outputs are NaN,
// as `quantize_activations` gives (its x^ NaN there) and the fp32 path's NaN x gives.
TRILLM_VNNI_TARGET void quantize_rows_range(const void* x, bool x_bf16, int64_t ld, int K, int r0,
                                            int r1, bool nibble_order, QuantizedRows& out) {
  constexpr int kHalf = kBlock / 2;
  const int nb = K / kBlock;
  const __m512 limit = _mm512_set1_ps(127.0f), limit_low = _mm512_set1_ps(-127.0f);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  // nibble order: word s of a half block holds k = 8 (s / 2) + (s % 2) + 2 i, i = 0 .. 3
  const __m128i order = nibble_order ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                                     : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = r0; r < r1; ++r) {
    for (int h = 0; h < 2 * nb; ++h) {
      __m512 v;
      if (x_bf16) {
        const uint16_t* xb = static_cast<const uint16_t*>(x) + r * ld + h * kHalf;
        v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))), 16));
      } else {
        v = _mm512_loadu_ps(static_cast<const float*>(x) + r * ld + h * kHalf);
      }
      const __m512 a = _mm512_abs_ps(v);
      // a NaN or an infinity: no scale rounds it, and vmaxps's reduction may drop a NaN (the
      // half block then rounded as if it were absent); dx NaN makes the row's every sum NaN
      const bool finite = _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ) == 0;
      const float dx =
          finite ? _mm512_reduce_max_ps(a) / 127.0f : std::numeric_limits<float>::quiet_NaN();
      const size_t i = static_cast<size_t>(r) * 2 * nb + h;
      int8_t* q = out.xq.data() + static_cast<size_t>(r) * K + h * kHalf;
      int sum = 0;
      if (dx > 0.0f) {
        __m512 t = _mm512_roundscale_ps(_mm512_div_ps(v, _mm512_set1_ps(dx)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm512_min_ps(limit, _mm512_max_ps(limit_low, t));
        const __m512i qi = _mm512_cvtps_epi32(t);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(qi), order));
        sum = _mm512_reduce_add_epi32(qi);
      } else {
        std::memset(q, 0, kHalf);
      }
      out.qxh[i] = sum;
      out.dx[i] = dx;
    }
    for (int b = 0; b < nb; ++b) {
      const size_t i = static_cast<size_t>(r) * 2 * nb + 2 * b;
      float sx = 0.0f;
      sx += out.dx[i] * static_cast<float>(out.qxh[i]);
      sx += out.dx[i + 1] * static_cast<float>(out.qxh[i + 1]);
      out.sx[static_cast<size_t>(r) * nb + b] = sx;
    }
  }
}

// All M rows, in chunks of 16 on `threads` threads (a scalar loop on one took ~20% of a
// prefill GEMM's time at K 8192). `nibble_order`: each half block's xq in the order of the
// prefill kernel's nibble unpacking (cpu_gemm_q_vnni_prefill.h, `nibble_order_type`), the same
// values and sums.
QuantizedRows quantize_rows(const void* x, bool x_bf16, int64_t ld, int M, int K, int threads,
                            bool nibble_order) {
  const int nb = K / kBlock;
  QuantizedRows out{std::vector<int8_t>(static_cast<size_t>(M) * K),
                    std::vector<float>(static_cast<size_t>(M) * 2 * nb),
                    std::vector<float>(static_cast<size_t>(M) * nb),
                    std::vector<int32_t>(static_cast<size_t>(M) * 2 * nb)};
  constexpr int kChunk = 16;
  const int chunks = (M + kChunk - 1) / kChunk;
  run_items(static_cast<int64_t>(M) * K < (1 << 16) ? 1 : threads, chunks, [&](int c) {
    quantize_rows_range(x, x_bf16, ld, K, c * kChunk, std::min(M, (c + 1) * kChunk), nibble_order,
                        out);
  });
  return out;
}

// tile's int8 twin: g.xq / g.dx / g.sx hold quantize_rows' output.
template <int R, int QT>
TRILLM_VNNI_TARGET void tile_vnni(const Gemm& g, int m, const uint8_t* p0, const uint8_t* p1,
                                  int col) {
  constexpr int qbytes = quant_bytes(QT);
  constexpr int rec = qbytes + param_bytes(QT);
  const int nb = g.K / kBlock;
  const uint8_t* panel[2] = {p0, p1};
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(0x000f000f), high = _mm512_set1_epi32(0x0f000f00);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int b = 0; b < nb; ++b) {
    __m512i dot[R][2];
    __m512 first[R][2];  // the first half block's dx_h0 * sum(q xq_h0) (all but half_scales)
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    for (int j = 0; j < kBlock / 2; j += 2) {  // k = 2j .. 2j + 3
      if (j == kBlock / 4) {  // the first half has its own activation scale: fold it in
        for (int p = 0; p < 2; ++p)
          for (int r = 0; r < R; ++r) {
            const int64_t i = static_cast<int64_t>(m + r) * nb + b;
            __m512i exact = dot[r][p];
            if constexpr (byte_values(QT))  // sum(q xq): the excess 128 sum(xq) taken out
              exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(128 * g.qxh[2 * i]));
            const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(g.dx[2 * i]));
            if constexpr (QT == kQ6_K) {  // and its own weight scale
              const uint8_t* params = panel[p] + static_cast<int64_t>(b) * rec + qbytes;
              acc[r][p] = add_half(acc[r][p], s, params, 0);
            } else if constexpr (half_min(QT)) {  // and its own scale and minimum
              const uint8_t* params = panel[p] + static_cast<int64_t>(b) * rec + qbytes;
              const float sxh = g.dx[2 * i] * static_cast<float>(g.qxh[2 * i]);
              acc[r][p] = add_half_min(acc[r][p], s, sxh, params, 0);
            } else {
              first[r][p] = s;
            }
            dot[r][p] = _mm512_setzero_si512();
          }
      }
      int32_t xw[R];  // four int8 activations of row r, as one word
      for (int r = 0; r < R; ++r)
        std::memcpy(&xw[r], g.xq + static_cast<int64_t>(m + r) * g.K + b * kBlock + 2 * j, 4);
      for (int p = 0; p < 2; ++p) {
        const uint8_t* q = panel[p] + static_cast<int64_t>(b) * rec + j * kCols;
        if constexpr (byte_values(QT)) {  // quad j / 2: 64 bytes, sign bits flipped (q + 128)
          const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(q + j * kCols), sign);
          for (int r = 0; r < R; ++r)
            dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], w, _mm512_set1_epi32(xw[r]));
          continue;
        }
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        const __m512i c = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kCols)));
        const __m512i t = _mm512_or_si512(a, _mm512_slli_epi32(c, 16));  // nibble pairs at bytes 0, 2
        // bytes 0..3 = q[2j], q[2j + 1], q[2j + 2], q[2j + 3]: (t & low) | ((t << 4) & high)
        __m512i w = _mm512_ternarylogic_epi32(_mm512_and_si512(t, low),
                                              _mm512_slli_epi32(t, 4), high, 0xF8);
        if constexpr (QT == kQ5_KM) {  // bit 4 of byte i: the fifth bit of k = 2j + i
          __mmask64 bits;
          std::memcpy(&bits, panel[p] + static_cast<int64_t>(b) * rec + kBlock / 2 * kCols + 4 * j, 8);
          w = _mm512_ternarylogic_epi32(w, _mm512_movm_epi8(bits), _mm512_set1_epi8(0x10), 0xF8);
        }
        for (int r = 0; r < R; ++r)
          dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], w, _mm512_set1_epi32(xw[r]));
      }
    }
    for (int p = 0; p < 2; ++p) {
      const uint8_t* params = panel[p] + static_cast<int64_t>(b) * rec + qbytes;
      for (int r = 0; r < R; ++r) {
        const int64_t i = static_cast<int64_t>(m + r) * nb + b;
        if constexpr (byte_values(QT))  // the second half's excess
          dot[r][p] = _mm512_sub_epi32(dot[r][p], _mm512_set1_epi32(128 * g.qxh[2 * i + 1]));
        // the second half: dx_h1 * its sum, added to the first's in one rounding (an explicit
        // FMA, as the prefill kernel takes it: a mul and an add left to the compiler were
        // fused either way round, differently for a 1-row tile than for 2-4)
        const __m512 sum = _mm512_cvtepi32_ps(dot[r][p]), dx1 = _mm512_set1_ps(g.dx[2 * i + 1]);
        __m512 s;
        if constexpr (half_scales(QT))
          s = _mm512_mul_ps(sum, dx1);
        else
          s = _mm512_fmadd_ps(sum, dx1, first[r][p]);
        // Q4_KM / Q5_KM: the second half's sum of x^, as quantize_rows adds it into sx
        const float sx = half_min(QT) ? g.dx[2 * i + 1] * static_cast<float>(g.qxh[2 * i + 1])
                                      : g.sx[i];
        acc[r][p] = add_block<QT>(acc[r][p], s, sx, params);
      }
    }
  }
  store_tile<R>(g, m, col, acc);
}
