// The int8-activation path of ext/cpu_gemm_q.cpp at prefill row counts (>= kPrefillMinRows) for
// the types with one weight scale per block (Q4_0, Q4_1, Q4_G, Q4_K, Q8_0), Q6_K (one per half
// block) and Q4_KM / Q5_KM (a scale and a minimum per half block), these with each half's fp32
// step as `tile_vnni` takes it: the same results bit for bit (Q6_KP unpacked straight from its
// records into Q6_K's unpacked form, cpu_gemm_q_q6.h); included there,
// inside its anonymous namespace, after cpu_gemm_q_vnni.h (whose activation rounding it keeps:
// one scale per half block of 16, the same int8 values, sums and scales).
//
// Why: `tile_vnni` unpacks each weight vector for 4 rows only (Q4: ~6 instructions per 4
// `vpdpbusd`) and converts every sum to fp32 with several more: at Llama-3.2-1B's shapes it ran
// at ~30% of this Zen 4 core's int8 peak (469 GOP/s a core by benchmarks/kernels/int8_peak.cpp,
// twice bf16's 235), below the bf16 GEMM. Here a work item is (256 rows, a run of pairs of panels:
// 32 columns each); per pair it first unpacks K once into a thread-local panel (`Unpacked`): per
// block, 8 quads x 2 zmm of `vpdpbusd`-ready bytes (Q4: q, 0..15; Q8_0: q + 128), then the
// block's fp32 scales (d; Q4_K: d * sc) and, for the types with a minimum, the fp32 factor of
// the block's sum of x^ (Q4_1: m; Q4_G: -d z; Q4_K: -dmin mn; each product exact in fp32);
// then every 4 rows of the item run over the whole K against it (from L2: 82 KiB a pair at K
// 2048, 328 KiB at 8192), 8 int32 sums (4 rows x 2 zmm), each weight vector feeding 4 and each
// broadcast quad of x 2. The offset of Q4_0 (q - 8) and of Q8_0's sign flip (q + 128 - 128) is
// the sums' starting value, -8 or -128 times the half block's integer sum of xq: exact and free.
// Per block and 16 columns the fp32 step is s = dx_h0 * I_h0 + dx_h1 * I_h1 (two conversions, a
// multiply, an FMA), acc += scale * s (+ minimum factor * sx): 3 to 4 multiply-unit
// instructions beside 8 `vpdpbusd`. Results equal `tile_vnni`'s up to the order of the fp32
// additions (the integer sums are the same; Q4_0's 8 sum(xq) is now taken out in integers).
// `vpdpbusd` is written as inline asm: GCC 12's code for the intrinsic in such a block copies
// each sum through the stack (int8_peak.cpp: 129 GOP/s a core instead of 469).

constexpr int kPrefillRows = 4;         // rows of the register block (x 2 panels)
constexpr int kPrefillRowBlock = 256;   // rows of x per work item (one unpacking per item)
constexpr int kPrefillMinRows = 64;     // fewer rows: tile_vnni (all but Q6_K: from 16, cpu_gemm_q.cpp)
constexpr int kPrefillKChunk = 2048;    // values of K per pass: 256 rows' int8 x (512 KiB) and the
                                        // pair's unpacked weights (82 KiB) stay in a 1 MiB L2

constexpr bool prefill_type(int qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ4_G || qtype == kQ4_K || qtype == kQ8_0 ||
         qtype == kQ6_K || half_min(qtype);
}

// The factor of the block's sum of x^ (a minimum): Q4_1, Q4_G, Q4_K.
constexpr bool prefill_min(int qtype) { return qtype == kQ4_1 || qtype == kQ4_G || qtype == kQ4_K; }

// The sums' starting value per half block, in units of -(its sum of xq): Q4_0 stores q (the
// value q - 8), Q8_0 and Q6_K run as q + 128.
constexpr int prefill_offset(int qtype) { return qtype == kQ4_0 ? 8 : byte_values(qtype) ? 128 : 0; }

// fp32 vectors a block and panel: the scale (d, d * sc); then the minimum factor, or (Q6_K, one
// weight scale per half block: d * sc[h]) the second half's scale; Q4_KM / Q5_KM (a scale and a
// minimum per half block): d * sc[0], d * sc[1], dmin * mn[0], dmin * mn[1]. Vector v of panel p
// at kUnpackedQuads + (2 v + p) * 64.
constexpr int prefill_vectors(int qtype) {
  return half_min(qtype) ? 4 : prefill_min(qtype) || qtype == kQ6_K ? 2 : 1;
}

// Bytes of one block of an unpacked pair: 8 quads x 2 zmm of bytes, 2 zmm of scales, and (types
// with a minimum) 2 zmm of minimum factors.
constexpr int kUnpackedQuads = 8 * 2 * 64;
constexpr int unpacked_block_bytes(int qtype) {
  return kUnpackedQuads + prefill_vectors(qtype) * 2 * 64;
}

TRILLM_VNNI_TARGET inline __m512i dpbusd(__m512i acc, __m512i w, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

// The nibble types whose unpacking takes four nibble-pair rows at a time (all but Q5_KM, whose
// fifth bits are laid out by k): one 64-byte load, a dword transpose (vpermd) and a byte
// transpose within each 128-bit lane (vpshufb) give column c's bytes of rows j .. j + 3 in lane
// c; their low nibbles are q[c][2 j + 2 i] and their high ones q[c][2 j + 2 i + 1] (i = 0 .. 3),
// two `vpdpbusd`-ready vectors in 6 instructions (the pairwise widening above: 7 for one).
// quantize_rows' `nibble_order` puts x's bytes in that order, within each half block of 16
// (a permutation of each 4-product sum's terms: exact, the same integer sums and results).
// At Llama-3.2-1B's shapes and 16 rows the unpacking was ~17% of the kernel's time before.
constexpr bool nibble_order_type(int qtype) {
  return prefill_type(qtype) && !byte_values(qtype) && qtype != kQ5_KM;
}

// Panels p0, p1 (all nb blocks) -> out, unpacked_block_bytes(QT) a block.
template <int QT>
TRILLM_VNNI_TARGET void unpack_pair(const uint8_t* p0, const uint8_t* p1, int nb, uint8_t* out) {
  constexpr int qbytes = quant_bytes(QT);
  constexpr int rec = qbytes + param_bytes(QT);
  constexpr int bytes = unpacked_block_bytes(QT);
  const __m512i low = _mm512_set1_epi32(0x000f000f), high = _mm512_set1_epi32(0x0f000f00);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bytes4x4 = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const uint8_t* panel[2] = {p0, p1};
  for (int b = 0; b < nb; ++b) {
    uint8_t* o = out + static_cast<int64_t>(b) * bytes;
    for (int p = 0; p < 2; ++p) {
      const uint8_t* r = panel[p] + static_cast<int64_t>(b) * rec;
      for (int quad = 0; nibble_order_type(QT) && quad < 8; quad += 2) {  // rows 2 quad .. 2 quad + 3
        const __m512i v = _mm512_shuffle_epi8(
            _mm512_permutexvar_epi32(dwords, _mm512_loadu_si512(r + 2 * quad * kCols)), bytes4x4);
        _mm512_store_si512(o + (quad * 2 + p) * 64, _mm512_and_si512(v, nibble));
        _mm512_store_si512(o + ((quad + 1) * 2 + p) * 64,
                           _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
      }
      for (int quad = 0; !nibble_order_type(QT) && quad < 8; ++quad) {
        __m512i w;
        if constexpr (byte_values(QT)) {
          w = _mm512_xor_si512(_mm512_loadu_si512(r + quad * 64), sign);
        } else {  // nibble-pair rows 2 quad, 2 quad + 1 -> bytes q[4 quad .. 4 quad + 3]
          const uint8_t* q = r + 2 * quad * kCols;
          const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
          const __m512i c = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kCols)));
          const __m512i t = _mm512_or_si512(a, _mm512_slli_epi32(c, 16));
          w = _mm512_ternarylogic_epi32(_mm512_and_si512(t, low), _mm512_slli_epi32(t, 4), high,
                                        0xF8);
          if constexpr (QT == kQ5_KM) {  // bit 4 of byte i: the fifth bit of k = 4 quad + i
            __mmask64 bits;
            std::memcpy(&bits, r + kBlock / 2 * kCols + 8 * quad, 8);
            w = _mm512_ternarylogic_epi32(w, _mm512_movm_epi8(bits), _mm512_set1_epi8(0x10), 0xF8);
          }
        }
        _mm512_store_si512(o + (quad * 2 + p) * 64, w);
      }
      const uint8_t* params = r + qbytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params)));
      __m512 scale = d, minimum = _mm512_setzero_ps();
      if constexpr (QT == kQ4_1)
        minimum = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 2 * kCols)));
      if constexpr (QT == kQ4_G)
        minimum = _mm512_sub_ps(_mm512_setzero_ps(),
                                _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                                     reinterpret_cast<const __m128i*>(params + 2 * kCols))))));
      if constexpr (QT == kQ4_K) {
        const Q4KScales q4k = load_q4_k_scales(params, d);
        scale = q4k.scale;
        minimum = _mm512_sub_ps(_mm512_setzero_ps(), q4k.minimum);
      }
      if constexpr (QT == kQ6_K) {  // d * sc[h], as add_half takes them
        scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 2 * kCols)))));
        minimum = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 3 * kCols)))));
      }
      if constexpr (half_min(QT)) {  // as add_half_min takes them
        const __m512 dmin = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 2 * kCols)));
        for (int v = 0; v < 4; ++v) {
          const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + (4 + v) * kCols))));
          _mm512_store_ps(reinterpret_cast<float*>(o + kUnpackedQuads + (2 * v + p) * 64),
                          _mm512_mul_ps(v < 2 ? d : dmin, f));
        }
        continue;
      }
      _mm512_store_ps(reinterpret_cast<float*>(o + kUnpackedQuads + p * 64), scale);
      if constexpr (prefill_vectors(QT) == 2)
        _mm512_store_ps(reinterpret_cast<float*>(o + kUnpackedQuads + (2 + p) * 64), minimum);
    }
  }
}

// store_tile's vectorized twin (its scalar bf16 rounding cost ~15% of a 4-row tile at K 2048):
// the same values, bf16 rounded to nearest even with NaN kept a quiet NaN as to_bf16 does.
template <int R>
TRILLM_VNNI_TARGET inline __attribute__((always_inline)) void store_prefill(
    const Gemm& g, int m, int col, const __m512 (&acc)[R][2]) {
  for (int p = 0; p < 2; ++p) {
    const int c0 = col + p * kCols;
    const int cols = std::min(kCols, g.N - c0);
    if (cols <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    __m512 b = _mm512_setzero_ps();
    if (g.bias != nullptr) b = _mm512_maskz_loadu_ps(mask, g.bias + c0);
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_add_ps(acc[r][p], b);
      if (!g.y_bf16) {
        _mm512_mask_storeu_ps(static_cast<float*>(g.y) + (m + r) * g.ldy + c0, mask, v);
        continue;
      }
      const __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(
          _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
      h = _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(g.y) + (m + r) * g.ldy + c0, mask,
                               _mm512_cvtepi32_epi16(h));
    }
  }
}

// The next step's packed records (the next chunk of K, or the next pair of the item's run),
// prefetched into L2 a few lines at a time over this step's register blocks, so that reading
// them from memory overlaps with the products instead of stalling the next unpacking (the
// 128,256 x 2,048 Q6_KP head at 16 rows: 21 of 52 ms in the unpacking, mostly waiting for
// memory, before; the register blocks run from L1 / L2 and leave the memory bus idle).
struct Prefetch {
  const uint8_t* panel[2] = {nullptr, nullptr};  // each panel's first line of the next records
  int64_t lines = 0;                             // 64-byte lines a panel
  int64_t issued = 0;                            // lines prefetched so far
  int64_t step = 0, steps = 1;                   // block iterations so far / in this step

  inline void advance() {  // one block iteration of a register block: its share of the lines
    const int64_t upto = lines * ++step / steps;
    for (; issued < upto; ++issued)
      for (const uint8_t* p : panel) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * issued), _MM_HINT_T1);
  }
};

// y[m .. m + R, col .. col + 32) from the unpacked pair u of blocks b0 .. b1: the sums start
// at zero (b0 0) or at part's (R rows x 32 fp32), and go to y (b1 the last block) or to part.
template <int R, int QT>
TRILLM_VNNI_TARGET inline __attribute__((always_inline)) void tile_prefill(
    const Gemm& g, int m, const uint8_t* u, int col, int b0, int b1, float* part, Prefetch& pf) {
  constexpr int bytes = unpacked_block_bytes(QT);
  constexpr int offset = prefill_offset(QT);
  const int nb = g.K / kBlock;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < 2; ++p)
      acc[r][p] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(part + (2 * r + p) * kCols);
  const int8_t* xq[R];
  const float* dx[R];
  const int32_t* qxh[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = g.xq + static_cast<int64_t>(m + r) * g.K;
    dx[r] = g.dx + static_cast<int64_t>(m + r) * 2 * nb;
    qxh[r] = g.qxh + static_cast<int64_t>(m + r) * 2 * nb;
  }
  for (int b = b0; b < b1; ++b) {
    pf.advance();
    const uint8_t* ub = u + static_cast<int64_t>(b - b0) * bytes;
    __m512 first[R][2];
    __m512i dot[R][2];
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < R; ++r) {
        const __m512i start = _mm512_set1_epi32(-offset * qxh[r][2 * b + h]);
        dot[r][0] = dot[r][1] = start;
      }
      for (int quad = 4 * h; quad < 4 * h + 4; ++quad) {
        const __m512i w0 = _mm512_load_si512(ub + (quad * 2) * 64);
        const __m512i w1 = _mm512_load_si512(ub + (quad * 2 + 1) * 64);
        for (int r = 0; r < R; ++r) {
          int32_t word;
          std::memcpy(&word, xq[r] + b * kBlock + 4 * quad, 4);
          const __m512i xw = _mm512_set1_epi32(word);
          dot[r][0] = dpbusd(dot[r][0], w0, xw);
          dot[r][1] = dpbusd(dot[r][1], w1, xw);
        }
      }
      if constexpr (QT == kQ6_K) {  // each half its own weight scale: tile_vnni's order
        for (int p = 0; p < 2; ++p) {
          const __m512 scale =
              _mm512_load_ps(reinterpret_cast<const float*>(ub + kUnpackedQuads + (2 * h + p) * 64));
          for (int r = 0; r < R; ++r) {
            const __m512 s =
                _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][p]), _mm512_set1_ps(dx[r][2 * b + h]));
            acc[r][p] = _mm512_fmadd_ps(scale, s, acc[r][p]);
          }
        }
        continue;
      }
      if constexpr (half_min(QT)) {  // a scale and a minimum per half: add_half_min's order
        for (int p = 0; p < 2; ++p) {
          const float* v = reinterpret_cast<const float*>(ub + kUnpackedQuads);
          const __m512 scale = _mm512_load_ps(v + (2 * h + p) * 16);
          const __m512 minimum = _mm512_load_ps(v + (2 * (2 + h) + p) * 16);
          for (int r = 0; r < R; ++r) {
            const float d = dx[r][2 * b + h];
            const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][p]), _mm512_set1_ps(d));
            const float sxh = d * static_cast<float>(qxh[r][2 * b + h]);
            acc[r][p] = _mm512_fnmadd_ps(minimum, _mm512_set1_ps(sxh),
                                         _mm512_fmadd_ps(scale, s, acc[r][p]));
          }
        }
        continue;
      }
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(dx[r][2 * b + h]);
        for (int p = 0; p < 2; ++p) {
          const __m512 s = _mm512_cvtepi32_ps(dot[r][p]);
          first[r][p] = h == 0 ? _mm512_mul_ps(s, d) : _mm512_fmadd_ps(s, d, first[r][p]);
        }
      }
    }
    if constexpr (QT == kQ6_K || half_min(QT)) continue;
    for (int p = 0; p < 2; ++p) {
      const __m512 scale = _mm512_load_ps(reinterpret_cast<const float*>(ub + kUnpackedQuads + p * 64));
      for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(scale, first[r][p], acc[r][p]);
      if constexpr (prefill_min(QT)) {
        const __m512 minimum =
            _mm512_load_ps(reinterpret_cast<const float*>(ub + kUnpackedQuads + (2 + p) * 64));
        for (int r = 0; r < R; ++r)
          acc[r][p] = _mm512_fmadd_ps(
              minimum, _mm512_set1_ps(g.sx[static_cast<int64_t>(m + r) * nb + b]), acc[r][p]);
      }
    }
  }
  if (b1 == nb) {
    store_prefill<R>(g, m, col, acc);
  } else {
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < 2; ++p) _mm512_store_ps(part + (2 * r + p) * kCols, acc[r][p]);
  }
}

// Rows m0 .. m1 (at most kPrefillRowBlock) of y's columns of the panel pairs pair0 .. pair1, a
// pair at a time: per chunk of K, `unpack(pair, b0, b1, out)` writes blocks b0 .. b1 of the pair
// in QT's unpacked form, then the register blocks run over them, their partial sums kept between
// chunks in a thread-local buffer, while the next chunk's records (`records(pair, b0, b1, at)`:
// each panel's first byte of them into at, their bytes a panel returned) are prefetched.
// The register blocks are inlined here (always_inline; this function carries the VNNI target
// so that they can be): called per 4 rows, each repeated its setup and passed its sums through
// the stack to a store_prefill call, ~20% of a K=576 GEMM's time (SmolLM2-135M's shapes).
template <int QT, typename Unpack, typename Records>
TRILLM_VNNI_TARGET void prefill_rows(const Gemm& g, int m0, int m1, int pair0, int pair1,
                                     Unpack unpack, Records records) {
  constexpr int kChunkBlocks = kPrefillKChunk / kBlock;
  static thread_local std::vector<uint8_t> storage;  // 64-byte aligned: unpacked pair, sums
  const int nb = g.K / kBlock;
  const size_t weights = static_cast<size_t>(std::min(nb, kChunkBlocks)) * unpacked_block_bytes(QT);
  const size_t need = weights + kPrefillRowBlock * 2 * kCols * sizeof(float) + 64;
  if (storage.size() < need) storage.resize(need);
  uint8_t* scratch = storage.data() + (-reinterpret_cast<uintptr_t>(storage.data()) & 63);
  float* sums = reinterpret_cast<float*>(scratch + weights);
  const int tiles = (m1 - m0 + kPrefillRows - 1) / kPrefillRows;
  for (int pair = pair0; pair < pair1; ++pair) {
    const int col = 2 * pair * kCols;
    for (int b0 = 0; b0 < nb; b0 += kChunkBlocks) {
      const int b1 = std::min(nb, b0 + kChunkBlocks);
      unpack(pair, b0, b1, scratch);
      Prefetch pf;
      const int next_pair = b1 < nb ? pair : pair + 1, next_b0 = b1 < nb ? b1 : 0;
      if (next_pair < pair1) {
        const int64_t bytes = records(next_pair, next_b0, std::min(nb, next_b0 + kChunkBlocks), pf.panel);
        pf.lines = (bytes + 63) / 64;
        pf.steps = static_cast<int64_t>(tiles) * (b1 - b0);
      }
      int m = m0;
      for (; m + kPrefillRows <= m1; m += kPrefillRows)
        tile_prefill<kPrefillRows, QT>(g, m, scratch, col, b0, b1, sums + (m - m0) * 2 * kCols, pf);
      float* part = sums + (m - m0) * 2 * kCols;
      switch (m1 - m) {
        case 1: tile_prefill<1, QT>(g, m, scratch, col, b0, b1, part, pf); break;
        case 2: tile_prefill<2, QT>(g, m, scratch, col, b0, b1, part, pf); break;
        case 3: tile_prefill<3, QT>(g, m, scratch, col, b0, b1, part, pf); break;
        default: break;
      }
    }
  }
}

// Rows m0 .. m1 (at most kPrefillRowBlock) of panel pairs pair0 .. pair1.
template <int QT>
void prefill_item(const Gemm& g, int m0, int m1, int pair0, int pair1) {
  const int64_t panel_bytes = static_cast<int64_t>(g.K / kBlock) * record_bytes(QT);
  const auto at = [&](int pair, int b) {
    return g.packed + 2 * pair * panel_bytes + static_cast<int64_t>(b) * record_bytes(QT);
  };
  prefill_rows<QT>(
      g, m0, m1, pair0, pair1,
      [&](int pair, int b0, int b1, uint8_t* out) {
        unpack_pair<QT>(at(pair, b0), at(pair, b0) + panel_bytes, b1 - b0, out);
      },
      [&](int pair, int b0, int b1, const uint8_t* (&first)[2]) {
        first[0] = at(pair, b0);
        first[1] = first[0] + panel_bytes;
        return static_cast<int64_t>(b1 - b0) * record_bytes(QT);
      });
}

void run_prefill_item(const Gemm& g, int m0, int m1, int pair0, int pair1) {
  switch (g.qtype) {
    case kQ4_0: prefill_item<kQ4_0>(g, m0, m1, pair0, pair1); break;
    case kQ4_1: prefill_item<kQ4_1>(g, m0, m1, pair0, pair1); break;
    case kQ4_G: prefill_item<kQ4_G>(g, m0, m1, pair0, pair1); break;
    case kQ4_K: prefill_item<kQ4_K>(g, m0, m1, pair0, pair1); break;
    case kQ6_K: prefill_item<kQ6_K>(g, m0, m1, pair0, pair1); break;
    case kQ4_KM: prefill_item<kQ4_KM>(g, m0, m1, pair0, pair1); break;
    case kQ5_KM: prefill_item<kQ5_KM>(g, m0, m1, pair0, pair1); break;
    default: prefill_item<kQ8_0>(g, m0, m1, pair0, pair1); break;
  }
}
