// The bf16-activation path of ext/cpu_gemm_q.cpp for the 4-bit types with one scale per block
// (Q4_0, Q4_1, Q4_G, Q4_K): taken where x comes in bf16, activations stay unquantized (fewer
// than INT8_MIN_ROWS rows: decode) and the CPU has AVX512-BF16 and AVX512-VBMI (Zen 4, Sapphire
// Rapids); included there, inside its anonymous namespace, after `tile`.
//
// Numerics: those of `tile` (the fp32 path). A bf16 x and a value 0..15 are exact in bf16 and
// their product exact in fp32, so `vdpbf16ps` (acc + a0 b0 + a1 b1, each step rounded to fp32)
// sums the same products as `tile`'s FMAs in another fixed order; only the order of the fp32
// additions differs (and denormal inputs / sums flush to zero, as the instruction does).
//
// Why: at batch 1 `tile` is bound by its vector instructions, not by memory: per 16 columns and
// two k, a zero-extending load, an AND, a shift, two int -> float conversions and two FMAs, ~12
// GB/s of Q4_0 weights per Zen 4 core against ~13 GB/s of DRAM bandwidth per core. Here one
// 64-byte load holds 16 columns x 8 k (nibble-pair rows j .. j + 3); `vpermb` transposes it so
// each column's 32-bit lane holds its four bytes (rows j .. j + 3), each 16-bit half two of
// them; shifting the halves by 0, 4, 8, 12 puts q[k0 + s] (low half) and q[k0 + s + 4] (high
// half) in each half's low four bits (k0 = 2j), and `vpermw` over a 32-word table (bf16(i & 15),
// so the index's fifth bit is ignored) turns them into a bf16 pair: 13 instructions for 16
// columns x 8 k where `tile` takes 28. The activations are rearranged to match, once per call:
// per 8 k, four words (x[k0 + s], x[k0 + s + 4]), s = 0..3 (`pair_rows`).

#define TRILLM_BF16DOT_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,f16c")))

bool cpu_has_bf16dot() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// Types this path runs: nibble pairs with one weight scale per block.
constexpr bool bf16dot_type(int qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ4_G || qtype == kQ4_K;
}

// bf16 rows [M][ldx] -> [M][K / 2] words: per 8 k (k0), word s = x[k0 + s] | x[k0 + s + 4] << 16.
std::vector<uint32_t> pair_rows(const uint16_t* x, int64_t ldx, int M, int K) {
  std::vector<uint32_t> out(static_cast<size_t>(M) * K / 2);
  for (int r = 0; r < M; ++r) {
    const uint16_t* xr = x + r * ldx;
    uint32_t* o = out.data() + static_cast<size_t>(r) * K / 2;
    for (int k0 = 0; k0 < K; k0 += 8)
      for (int s = 0; s < 4; ++s)
        o[k0 / 2 + s] = xr[k0 + s] | static_cast<uint32_t>(xr[k0 + s + 4]) << 16;
  }
  return out;
}

// tile's bf16 twin: g.xp holds pair_rows' output. Independent sums per (row, panel): four at
// one row (the dot products' latency), fewer as rows supply more chains.
template <int R, int QT>
TRILLM_BF16DOT_TARGET void tile_bf16(const Gemm& g, int m, const uint8_t* p0, const uint8_t* p1,
                                     int col) {
  constexpr int qbytes = quant_bytes(QT);
  constexpr int rec = qbytes + param_bytes(QT);
  constexpr int kA = R == 1 ? 4 : R == 2 ? 2 : 1;
  const int nb = g.K / kBlock;
  const uint8_t* panel[2] = {p0, p1};
  // byte 4c + i of the transposed load = byte 16 i + c (row j + i, column c)
  alignas(64) uint8_t order[64];
  for (int n = 0; n < 64; ++n) order[n] = static_cast<uint8_t>(16 * (n % 4) + n / 4);
  const __m512i transpose = _mm512_load_si512(order);
  alignas(64) uint16_t values[32];  // bf16(i & 15)
  for (int i = 0; i < 32; ++i) values[i] = to_bf16(static_cast<float>(i & 15));
  const __m512i table = _mm512_load_si512(values);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    prefetch_gemv_records(panel, b, nb, rec);  // ext/cpu_gemm_q.cpp
    __m512 dot[R][2][kA];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < 2; ++p)
        for (int a = 0; a < kA; ++a) dot[r][p][a] = _mm512_setzero_ps();
    for (int t = 0; t < kBlock / 8; ++t) {  // k0 = 8t: nibble-pair rows 4t .. 4t + 3
      uint32_t xw[R][4];
      for (int r = 0; r < R; ++r)
        std::memcpy(xw[r], g.xp + static_cast<int64_t>(m + r) * (g.K / 2) + b * (kBlock / 2) + 4 * t,
                    16);
      for (int p = 0; p < 2; ++p) {
        const __m512i v = _mm512_permutexvar_epi8(
            transpose, _mm512_loadu_si512(panel[p] + static_cast<int64_t>(b) * rec + 4 * t * kCols));
        for (int s = 0; s < 4; ++s) {
          const __m512i idx = s == 0 ? v : _mm512_srli_epi16(v, 4 * s);
          const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, table);
          for (int r = 0; r < R; ++r)
            dot[r][p][s % kA] = _mm512_dpbf16_ps(
                dot[r][p][s % kA], w, (__m512bh)_mm512_set1_epi32(static_cast<int>(xw[r][s])));
        }
      }
    }
    for (int p = 0; p < 2; ++p) {
      const uint8_t* params = panel[p] + static_cast<int64_t>(b) * rec + qbytes;
      for (int r = 0; r < R; ++r) {
        __m512 s = dot[r][p][0];
        for (int a = 1; a < kA; ++a) s = _mm512_add_ps(s, dot[r][p][a]);
        acc[r][p] = add_block<QT>(acc[r][p], s, g.sx[(m + r) * nb + b], params);
      }
    }
  }
  store_tile<R>(g, m, col, acc);
}
