// Q6_KP: GGUF's Q6_K packed at the file's size (6.5625 bits a weight; Q6_K's kernel form is 9),
// for ext/cpu_gemm_q.cpp on CPUs with AVX512-BF16 and AVX512-VBMI (kernels/linear_q_cpu.py packs
// Q6_K so only there); included there, inside its anonymous namespace, after `run_pair`.
//
// Layout of a panel of 16 columns: per super-block of 256 k (K % 256 == 0), d[16] fp16, then
// eight blocks of 32 k of 416 bytes each:
//   nibbles  16 pair-rows j x 16 columns, byte [j][c] = u[c][2j] & 15 | (u[c][2j + 1] & 15) << 4,
//            u = q + 32 (0..63): the Q4 types' layout;
//   highs    2 x 16 columns x uint32: lane c of vector h holds the top two bits of u[c][k] for
//            k = 16 h + 8 g + 4 e + s (g, e 0..1, s 0..3) at bit pos(s) + 2 g + 16 e, pos(s) =
//            4, 8, 12, 0: shifted as the nibbles are (below), each lands on bits 4..5;
//   sc[2][16] int8, the scales of k 0..15 and 16..31.
// 8 x 416 + 32 = 3,360 bytes per 16 x 256 weights; record_bytes() says 420 per block of 32.
//
// Batch 1 (bf16 rows, `tile_q6kp_bf16`): as cpu_gemm_q_bf16.h's Q4 path, one 64-byte load and
// `vpermb` give each column's lane four nibble rows; for each s the lane's 16-bit halves shifted
// by 4 s hold u[k0 + s] and u[k0 + s + 4] in their low four bits, the high vector shifted to
// put the same k's top bits at bits 4..5, and one `vpternlogd` merges them: a 6-bit index per
// word, which `vpermt2w` over a 64-word table turns into bf16(u - 32) = bf16(q) (exact). The
// products x * q are exact in fp32, summed per half block by `vdpbf16ps`, then (d * sc) * s:
// the numerics of Q6_K's fp32 kernel up to the order of the fp32 additions.
// Other paths (fp32 rows, int8 activations below 16 rows, the AVX2 kernel): each work item
// expands its pair of panels into Q6_K's 9-bit records in a thread-local buffer (vectorised
// where this header's kernel runs, scalar under the AVX2 kernel) and runs Q6_K's kernels on
// them; int8 activations from 16 rows: Q6_K's prefill item, its unpacked pair made straight from
// Q6_KP's records (`unpack_pair_q6kp`). The same results as a weight packed as Q6_K.

constexpr int kQ6Blocks = 8;                                                  // blocks a super-block
constexpr int kQ6BlockBytes = kBlock / 2 * kCols + kBlock / 4 * kCols + 2 * kCols;  // 416
constexpr int kQ6SuperBytes = 2 * kCols + kQ6Blocks * kQ6BlockBytes;          // 3,360

inline const uint8_t* q6kp_super(const uint8_t* panel, int b) {
  return panel + static_cast<int64_t>(b / kQ6Blocks) * kQ6SuperBytes;
}

inline const uint8_t* q6kp_block(const uint8_t* panel, int b) {
  return q6kp_super(panel, b) + 2 * kCols + (b % kQ6Blocks) * kQ6BlockBytes;
}

// The 6-bit indices of k0 + s (low words) and k0 + s + 4 (high words), s = 0..3, from the
// transposed nibbles v and the high vector hv of group g (k0 = 16 h + 8 g).
template <int G>
TRILLM_BF16DOT_TARGET inline void q6kp_indices(__m512i v, __m512i hv, __m512i (&idx)[4]) {
  const __m512i keep = _mm512_set1_epi32(0x000f000f);
  // (keep ? nibbles : highs) bit by bit: 0xE4
  idx[0] = _mm512_ternarylogic_epi32(v, G == 0 ? hv : _mm512_srli_epi16(hv, 2), keep, 0xE4);
  idx[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_srli_epi16(hv, 4 + 2 * G),
                                     keep, 0xE4);
  idx[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), _mm512_srli_epi16(hv, 8 + 2 * G),
                                     keep, 0xE4);
  idx[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 12), _mm512_slli_epi16(hv, 4 - 2 * G),
                                     keep, 0xE4);
}

TRILLM_BF16DOT_TARGET inline __m512i q6kp_transpose() {
  alignas(64) uint8_t order[64];  // byte 4c + i of the transposed load = byte 16 i + c
  for (int n = 0; n < 64; ++n) order[n] = static_cast<uint8_t>(16 * (n % 4) + n / 4);
  return _mm512_load_si512(order);
}

// y[m..m+R, col..col+32) from bf16 rows (g.xp: pair_rows' words) and Q6_KP panels p0, p1.
template <int R>
TRILLM_BF16DOT_TARGET void tile_q6kp_bf16(const Gemm& g, int m, const uint8_t* p0,
                                          const uint8_t* p1, int col) {
  constexpr int kA = R == 1 ? 4 : R == 2 ? 2 : 1;
  const int nb = g.K / kBlock;
  const uint8_t* panel[2] = {p0, p1};
  const __m512i transpose = q6kp_transpose();
  alignas(64) uint16_t values[64];  // bf16(i - 32): index bit 5 picks the second table
  for (int i = 0; i < 64; ++i) values[i] = to_bf16(static_cast<float>(i - 32));
  const __m512i low_table = _mm512_load_si512(values), high_table = _mm512_load_si512(values + 32);
  __m512 acc[R][2], d[2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    if (b % kQ6Blocks == 0)
      for (int p = 0; p < 2; ++p)
        d[p] = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q6kp_super(panel[p], b))));
    const uint8_t* rec[2] = {q6kp_block(p0, b), q6kp_block(p1, b)};
    __m512 dot[R][2][kA];
    for (int t = 0; t < kBlock / 8; ++t) {  // k0 = 8t: nibble rows 4t .. 4t + 3, group t & 1
      if (t % 2 == 0)
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < 2; ++p)
            for (int a = 0; a < kA; ++a) dot[r][p][a] = _mm512_setzero_ps();
      uint32_t xw[R][4];
      for (int r = 0; r < R; ++r)
        std::memcpy(xw[r], g.xp + static_cast<int64_t>(m + r) * (g.K / 2) + b * (kBlock / 2) + 4 * t,
                    16);
      for (int p = 0; p < 2; ++p) {
        const __m512i v = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(rec[p] + 64 * t));
        const __m512i hv = _mm512_loadu_si512(rec[p] + kBlock / 2 * kCols + 64 * (t / 2));
        __m512i idx[4];
        if (t % 2 == 0)
          q6kp_indices<0>(v, hv, idx);
        else
          q6kp_indices<1>(v, hv, idx);
        for (int s = 0; s < 4; ++s) {
          const __m512bh w = (__m512bh)_mm512_permutex2var_epi16(low_table, idx[s], high_table);
          for (int r = 0; r < R; ++r)
            dot[r][p][s % kA] = _mm512_dpbf16_ps(
                dot[r][p][s % kA], w, (__m512bh)_mm512_set1_epi32(static_cast<int>(xw[r][s])));
        }
      }
      if (t % 2 == 1) {  // half block t / 2 done: (d * sc[half]) * its sums
        for (int p = 0; p < 2; ++p) {
          const __m512 scale = _mm512_mul_ps(
              d[p], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        reinterpret_cast<const __m128i*>(rec[p] + 3 * kBlock / 4 * kCols +
                                                         (t / 2) * kCols)))));
          for (int r = 0; r < R; ++r) {
            __m512 s = dot[r][p][0];
            for (int a = 1; a < kA; ++a) s = _mm512_add_ps(s, dot[r][p][a]);
            acc[r][p] = _mm512_fmadd_ps(scale, s, acc[r][p]);
          }
        }
      }
    }
  }
  store_tile<R>(g, m, col, acc);
}

// Quads 2t and 2t + 1 of a Q6_KP block record `rec` (k0 = 8t): per column's lane, the bytes
// u = q + 32 (0..63) of k0 .. k0 + 3 (quad[0]) and k0 + 4 .. k0 + 7 (quad[1]).
TRILLM_BF16DOT_TARGET inline void q6kp_quads(const uint8_t* rec, int t, __m512i transpose,
                                             __m512i (&quad)[2]) {
  const __m512i six = _mm512_set1_epi32(0x003f003f), word = _mm512_set1_epi32(0x0000ffff);
  const __m512i v = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(rec + 64 * t));
  const __m512i hv = _mm512_loadu_si512(rec + kBlock / 2 * kCols + 64 * (t / 2));
  __m512i idx[4];
  if (t % 2 == 0)
    q6kp_indices<0>(v, hv, idx);
  else
    q6kp_indices<1>(v, hv, idx);
  for (auto& i : idx) i = _mm512_and_si512(i, six);
  // words u[k0], u[k0 + 1] | u[k0 + 4], u[k0 + 5] and u[k0 + 2], u[k0 + 3] | u[k0 + 6], u[k0 + 7]
  const __m512i t01 = _mm512_or_si512(idx[0], _mm512_slli_epi32(idx[1], 8));
  const __m512i t23 = _mm512_or_si512(idx[2], _mm512_slli_epi32(idx[3], 8));
  quad[0] = _mm512_ternarylogic_epi32(t01, _mm512_slli_epi32(t23, 16), word, 0xE4);
  quad[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(t01, 16), t23, word, 0xE4);
}

// nb blocks of a Q6_KP panel -> Q6_K's records (cpu_gemm_q.cpp: 8 quads x 16 columns x 4 int8
// q, d[16] fp16, sc[2][16] int8), vectorised.
TRILLM_BF16DOT_TARGET void expand_q6kp(const uint8_t* panel, int nb, uint8_t* out) {
  const __m512i transpose = q6kp_transpose();
  const __m512i bias = _mm512_set1_epi8(32);
  constexpr int rec_out = kBlock * kCols + 4 * kCols;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* rec = q6kp_block(panel, b);
    uint8_t* o = out + static_cast<int64_t>(b) * rec_out;
    for (int t = 0; t < kBlock / 8; ++t) {
      __m512i quad[2];
      q6kp_quads(rec, t, transpose, quad);
      _mm512_storeu_si512(o + 2 * t * 64, _mm512_sub_epi8(quad[0], bias));
      _mm512_storeu_si512(o + (2 * t + 1) * 64, _mm512_sub_epi8(quad[1], bias));
    }
    std::memcpy(o + kBlock * kCols, q6kp_super(panel, b), 2 * kCols);
    std::memcpy(o + kBlock * kCols + 2 * kCols, rec + 3 * kBlock / 4 * kCols, 2 * kCols);
  }
}

// The same, one value at a time (the AVX2 kernel's hosts).
void expand_q6kp_scalar(const uint8_t* panel, int nb, uint8_t* out) {
  constexpr int rec_out = kBlock * kCols + 4 * kCols;
  constexpr int pos[4] = {4, 8, 12, 0};
  for (int b = 0; b < nb; ++b) {
    const uint8_t* rec = q6kp_block(panel, b);
    uint8_t* o = out + static_cast<int64_t>(b) * rec_out;
    for (int c = 0; c < kCols; ++c)
      for (int k = 0; k < kBlock; ++k) {
        const int nib = (rec[(k / 2) * kCols + c] >> (4 * (k & 1))) & 15;
        uint32_t lane;
        std::memcpy(&lane, rec + kBlock / 2 * kCols + 64 * (k / 16) + 4 * c, 4);
        const int g = (k % 16) / 8, e = (k % 8) / 4, s = k % 4;
        const int u = nib | static_cast<int>((lane >> (pos[s] + 2 * g + 16 * e)) & 3) << 4;
        o[(k / 4) * 64 + 4 * c + k % 4] = static_cast<uint8_t>(static_cast<int8_t>(u - 32));
      }
    std::memcpy(o + kBlock * kCols, q6kp_super(panel, b), 2 * kCols);
    std::memcpy(o + kBlock * kCols + 2 * kCols, rec + 3 * kBlock / 4 * kCols, 2 * kCols);
  }
}

// One work item's rows m0..m1 against panel pair `pair` of a Q6_KP weight.
void run_pair_q6kp(const Gemm& g, int m0, int m1, int pair, bool wide) {
  const int64_t panel_bytes = static_cast<int64_t>(g.K / kBlock) * record_bytes(kQ6_KP);
  const uint8_t* p0 = g.packed + 2 * pair * panel_bytes;
  const int col = 2 * pair * kCols;
  if (g.xp != nullptr) {
    int m = m0;
    for (; m + kRows <= m1; m += kRows) tile_q6kp_bf16<kRows>(g, m, p0, p0 + panel_bytes, col);
    switch (m1 - m) {
      case 1: tile_q6kp_bf16<1>(g, m, p0, p0 + panel_bytes, col); break;
      case 2: tile_q6kp_bf16<2>(g, m, p0, p0 + panel_bytes, col); break;
      case 3: tile_q6kp_bf16<3>(g, m, p0, p0 + panel_bytes, col); break;
      default: break;
    }
    return;
  }
  const int nb = g.K / kBlock;
  const int64_t expanded = static_cast<int64_t>(nb) * record_bytes(kQ6_K);
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(2 * expanded);
  for (int p = 0; p < 2; ++p)
    wide ? expand_q6kp(p0 + p * panel_bytes, nb, buffer.data() + p * expanded)
         : expand_q6kp_scalar(p0 + p * panel_bytes, nb, buffer.data() + p * expanded);
  Gemm as_q6_k = g;  // the pair as panels 0 and 1 of a Q6_K weight of the columns from col on
  as_q6_k.packed = buffer.data();
  as_q6_k.qtype = kQ6_K;
  as_q6_k.N = g.N - col;
  as_q6_k.y = static_cast<char*>(g.y) + col * (g.y_bf16 ? 2 : 4);
  as_q6_k.bias = g.bias == nullptr ? nullptr : g.bias + col;
  wide ? run_pair(as_q6_k, m0, m1, 0) : run_pair_avx2(as_q6_k, m0, m1, 0);
}

// Blocks b0 .. b1 (b0 a multiple of kQ6Blocks) of Q6_KP panels p0, p1 -> the unpacked pair
// `unpack_pair<kQ6_K>` makes of Q6_K's records (cpu_gemm_q_vnni_prefill.h: bytes q + 128 =
// u + 96; fp32 d * sc[0], d * sc[1]), straight from the 6.5625-bit records: the same bytes and
// scales without expand_q6kp's 9-bit records between.
TRILLM_BF16DOT_TARGET void unpack_pair_q6kp(const uint8_t* p0, const uint8_t* p1, int b0, int b1,
                                            uint8_t* out) {
  constexpr int bytes = unpacked_block_bytes(kQ6_K);
  const __m512i transpose = q6kp_transpose();
  const __m512i bias = _mm512_set1_epi8(96);
  const uint8_t* panel[2] = {p0, p1};
  for (int b = b0; b < b1; ++b) {
    uint8_t* o = out + static_cast<int64_t>(b - b0) * bytes;
    for (int p = 0; p < 2; ++p) {
      const uint8_t* rec = q6kp_block(panel[p], b);
      for (int t = 0; t < kBlock / 8; ++t) {
        __m512i quad[2];
        q6kp_quads(rec, t, transpose, quad);
        _mm512_store_si512(o + (4 * t + p) * 64, _mm512_add_epi8(quad[0], bias));
        _mm512_store_si512(o + (4 * t + 2 + p) * 64, _mm512_add_epi8(quad[1], bias));
      }
      const __m512 d = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q6kp_super(panel[p], b))));
      const uint8_t* sc = rec + 3 * kBlock / 4 * kCols;
      for (int h = 0; h < 2; ++h)  // the unpacked pair's scale vector h of panel p
        _mm512_store_ps(reinterpret_cast<float*>(o + kUnpackedQuads + (2 * h + p) * 64),
                        _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                             reinterpret_cast<const __m128i*>(sc + h * kCols))))));
    }
  }
}

// The int8 prefill kernel (cpu_gemm_q_vnni_prefill.h) on rows m0..m1 of Q6_KP pairs pair0 ..
// pair1: Q6_K's item, each chunk of a pair unpacked straight from Q6_KP's records
// (unpack_pair_q6kp): the same results as a weight packed as Q6_K.
void run_prefill_item_q6kp(const Gemm& g, int m0, int m1, int pair0, int pair1) {
  const int64_t panel_bytes = static_cast<int64_t>(g.K / kBlock) * record_bytes(kQ6_KP);
  const auto panel = [&](int pair) { return g.packed + 2 * pair * panel_bytes; };
  prefill_rows<kQ6_K>(
      g, m0, m1, pair0, pair1,
      [&](int pair, int b0, int b1, uint8_t* out) {
        unpack_pair_q6kp(panel(pair), panel(pair) + panel_bytes, b0, b1, out);
      },
      [&](int pair, int b0, int b1, const uint8_t* (&first)[2]) {  // whole super-blocks
        first[0] = q6kp_super(panel(pair), b0);
        first[1] = first[0] + panel_bytes;
        return static_cast<int64_t>(b1 - b0) / kQ6Blocks * kQ6SuperBytes;
      });
}
