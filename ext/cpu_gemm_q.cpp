// GEMM with block-quantized weights kept quantized (GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, and Q4_G,
// trillm's form of AWQ / GPTQ 4-bit groups: blocks of 32 values along K, one fp16 scale per
// block, Q4_1 an fp16 minimum too, Q4_G a 4-bit zero point, Q4_K its super-block's fp16 d and
// dmin with the block's 6-bit scale and minimum, Q6_K its super-block's fp16 d with an int8
// scale for each half of the block; and Q4_KM / Q5_KM, trillm's: 4-bit / 5-bit values with the
// super-block's fp16 d and dmin and an int8 scale and minimum for each half of the block). GGUF's
// Q5_K (q 0..31, its 6-bit scale and minimum per 32 repeated per 16) is repacked into Q5_KM's
// form, Q2_K (q 0..3, 4-bit scale and minimum per 16) and Q3_K (q + 4 in 0..7, scale sc - 32,
// dmin = d and minimum 4 (sc - 32)) into Q4_KM's, all exactly (kernels/linear_q_cpu.py):
// y[M, N] = x[M, K] . W[N, K]^T (+ bias), x fp32 or bf16, y fp32 or bf16, products summed in fp32.
//
// Numerics: those of dequantize-then-matmul in fp32. Per block b and column n the kernel sums
// s = sum_k x[k] * q[n][k] in fp32 over the block's raw integers (0..15 for Q4, -128..127 for Q8,
// exact as floats), then adds d * s (Q4_0: d * (s - 8 * sum_k x[k]); Q4_1: d * s + m * sum_k
// x[k]; Q4_G: d * (s - z * sum_k x[k]), z the block's zero point of this column; Q4_K:
// (d * sc) * s - (dmin * mn) * sum_k x[k], both products exact in fp32; Q6_K: (d * sc) * s per
// half block of 16, s over that half; Q4_KM / Q5_KM: Q4_K's per half block, sum_k x[k] over
// that half too). Only the
// order of the fp32 additions differs from F.linear on the dequantized weight.
// Activations are not quantized by default: a GGUF model served in fp32 keeps the greedy output
// of the same model dequantized. `int8_activations` (AVX512-VNNI) rounds them to int8 per half
// block of 16 and sums with `vpdpbusd` instead (cpu_gemm_q_vnni.h), as llama.cpp does per 32.
//
// Packed layout (written by kernels/q_panels.py's pack, read here): N is cut into panels of
// 16 output columns, their count padded to even (the kernel takes two panels at a time, zero
// columns beyond N); panel p is nb = K / 32 records, one per block of 32 k, each:
//   Q4_0 / Q4_1 / Q4_G / Q4_K / Q4_KM: 16 k-pairs x 16 columns of bytes, byte [j][c] =
//                q[c][2j] | q[c][2j + 1] << 4, then d[16] fp16, then (Q4_1) m[16] fp16, (Q4_G)
//                z[16] uint8, (Q4_K) dmin[16] fp16, sc[16] uint8, mn[16] uint8 (d and dmin
//                repeat over the 8 blocks of a super-block: 5.5 bits a weight against the
//                file's 4.5), (Q4_KM) dmin[16] fp16, sc[2][16] int8, mn[2][16] int8 for k 0..15
//                and 16..31 (6 bits a weight: Q3_K's file 3.44, Q2_K's 2.625);
//   Q8_0 / Q6_K: 8 quads x 16 columns x 4 int8, byte [j][c][i] = q[c][4j + i], then d[16]
//                fp16, then (Q6_K, q - 32 stored) sc[2][16] int8, the scales of k 0..15 and
//                16..31 (9 bits a weight against the file's 6.56: one byte a value keeps the
//                int8 kernels' loads; d repeats over the 8 blocks of a super-block); where
//                the CPU has AVX512-BF16 and VBMI Q6_K is packed as Q6_KP instead, at the
//                file's 6.5625 bits (cpu_gemm_q_q6.h);
//   Q5_KM: Q4's nibble pairs (q & 15), then hb[8] uint64, bit 4c + i of hb[j] the fifth bit
//                of q[c][4j + i], then Q4_KM's parameters (7 bits a weight against Q5_K's
//                file's 5.5);
// Q4: one 16-byte load and a zero-extension give 16 columns' integers for two k (Q5_KM: hb[j] as
// a mask, `vpmovm2b`, gives each column's 32-bit lane 0xff in byte i where q[c][4j + i] >= 16:
// its bit 4, shifted to a lane's low byte, is the fifth bit of one k; the int8 path ORs the
// lanes' bit 4s into its bytes as they are). Q8: one 64-byte
// load gives 16 columns' integers for four k, each column's four in one 32-bit lane: the operand
// `vpdpbusd` multiplies as it is (int8 path), two shifts sign-extend one k of it (fp32 path).
// Work items: (block of rows, run of panel pairs) on the shared pool; the summation order per
// output is fixed, so results do not depend on the thread count.
// On CPUs without AVX512F/BW/VL an AVX2 / FMA / F16C kernel over the same layout runs instead
// (cpu_gemm_q_avx2.h; `set_isa` picks either where both run); `supported()` is false without
// AVX2 / FMA / F16C (checked at run time): callers then dequantize and call torch
// (kernels/linear_q_cpu.py).
#include <pybind11/pybind11.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_common.h"
#include "cpu_program.h"

namespace py = pybind11;

namespace {

constexpr int kCols = 16;       // output columns per panel: one fp32 vector
constexpr int kBlock = 32;      // values per quantization block along K
constexpr int kRows = 4;        // rows of x per register tile (x 2 panels)
constexpr int kRowBlock = 64;   // rows of x per work item
constexpr int kInt8UnpackedMinRows = 16;  // int8 rows to the prefill kernel (not Q6_K)

// GGML's type ids; Q4_G is trillm's (not a GGML type): AWQ / GPTQ groups cut into blocks of 32.
// Q5_KM and Q4_KM are trillm's too: 5-bit / 4-bit values with a scale and a minimum per half
// block of 16 (the forms GGUF's Q5_K, and Q3_K and Q2_K, are repacked into).
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kQ4_G = 100, kQ5_KM = 101, kQ4_KM = 102,
  kQ6_KP = 103  // trillm's: Q6_K at the file's size (cpu_gemm_q_q6.h)
};

// Types whose values are stored one signed byte each (in quads), not as nibble pairs.
constexpr bool byte_values(int qtype) { return qtype == kQ8_0 || qtype == kQ6_K; }

// Types with a scale and a minimum per half block of 16 (fed sums of x per half block).
constexpr bool half_min(int qtype) { return qtype == kQ5_KM || qtype == kQ4_KM; }

// Q5_KM: bytes of the fifth-bit masks after the nibbles (one uint64 per quad of k).
constexpr int kHighBytes = 2 * kBlock;

// Types with a weight scale per half block of 16 (the first half folded in mid-block).
constexpr bool half_scales(int qtype) { return qtype == kQ6_K || half_min(qtype); }

constexpr int quant_bytes(int qtype) {
  return byte_values(qtype) ? kBlock * kCols : kBlock / 2 * kCols + (qtype == kQ5_KM ? kHighBytes : 0);
}

// Bytes of the values and per-column parameters of one (panel, block) record.
constexpr int param_bytes(int qtype) {
  return 2 * kCols + (qtype == kQ4_1   ? 2 * kCols
                      : qtype == kQ4_G ? kCols
                      : qtype == kQ4_K ? 4 * kCols
                      : qtype == kQ6_K ? 2 * kCols
                      : half_min(qtype) ? 6 * kCols
                                        : 0);
}

// Bytes of one (panel, block) record.
int record_bytes(int qtype) {
  if (qtype == kQ6_KP) return 420;  // a super-block's 3,360 bytes over its 8 blocks
  if (qtype != kQ4_0 && qtype != kQ4_1 && qtype != kQ8_0 && qtype != kQ4_K && qtype != kQ6_K &&
      qtype != kQ4_G && !half_min(qtype))
    throw std::invalid_argument(
        "quantized GEMM: type must be Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q6_K (14), "
        "Q4_G (100), Q5_KM (101), Q4_KM (102) or Q6_KP (103)");
  return quant_bytes(qtype) + param_bytes(qtype);
}

int num_panels(int N) {
  const int panels = (N + kCols - 1) / kCols;
  return panels + (panels & 1);
}

bool cpu_has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

#define TRILLM_Q_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

#include "cpu_gemm_q_params.h"

struct Gemm {
  const float* x;   // fp32 rows, stride ldx
  int64_t ldx;
  const float* sx;  // Q4: per row, per block, the sum of x over the block [M][nb]; Q4_KM /
                    // Q5_KM: per half block [M][2 nb]; else null
  const int8_t* xq;  // int8 path (cpu_gemm_q_vnni.h): x rounded to int8 [M][K]; else null
  const float* dx;   // int8 path: per row, per half block, the scale of xq [M][2 nb]
  const int32_t* qxh;  // int8 path: per row, per half block, the sum of xq [M][2 nb]
  const uint32_t* xp;  // bf16 path (cpu_gemm_q_bf16.h): x's bf16 pairs [M][K / 2]; else null
  const uint8_t* packed;
  const float* bias;  // null: none
  void* y;
  int64_t ldy;
  int M, N, K, qtype;
  bool y_bf16;
};

// fp32 -> bf16, round to nearest even (NaN kept a quiet NaN), as torch's cast does.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Q6_K: acc + (d * sc[half]) * s for 16 columns, s the sums of x * q over that half block.
TRILLM_Q_TARGET inline __m512 add_half(__m512 acc, __m512 s, const uint8_t* params, int half) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params)));
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + (2 + half) * kCols))));
  return _mm512_fmadd_ps(_mm512_mul_ps(d, sc), s, acc);
}

// Q4_KM / Q5_KM: acc + (d * sc[half]) * s - (dmin * mn[half]) * sx for 16 columns, s the sums
// of x * q over that half block, sx its sum of x; `params` d[16] fp16, dmin[16] fp16, sc[2][16]
// int8, mn[2][16] int8.
TRILLM_Q_TARGET inline __m512 add_half_min(__m512 acc, __m512 s, float sx, const uint8_t* params,
                                           int half) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params)));
  const __m512 dmin = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 2 * kCols)));
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + (4 + half) * kCols))));
  const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + (6 + half) * kCols))));
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, sc), s, acc);
  return _mm512_fnmadd_ps(_mm512_mul_ps(dmin, mn), _mm512_set1_ps(sx), acc);
}

// acc + one block's share of 16 columns: d * (s - 8 sx) (Q4_0), d * s + m * sx (Q4_1),
// d * (s - z sx) (Q4_G), d * s (Q8_0), (d sc) * s - (dmin mn) * sx (Q4_K), (d sc[1]) * s (Q6_K:
// the second half, s its sums; add_half took the first), Q4_KM's / Q5_KM's second half (sx that
// half's sum of x; add_half_min took the first); s the block's sums
// of x * q, sx its sum of x, `params` the record's d[16] fp16 (then m[16] fp16, z[16] uint8 or
// dmin[16] fp16, sc[16] uint8, mn[16] uint8).
template <int QT>
TRILLM_Q_TARGET inline __m512 add_block(__m512 acc, __m512 s, float sx, const uint8_t* params) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params)));
  if constexpr (QT == kQ6_K) return add_half(acc, s, params, 1);
  if constexpr (half_min(QT)) return add_half_min(acc, s, sx, params, 1);
  if constexpr (QT == kQ4_K) {
    const Q4KScales q4k = load_q4_k_scales(params, d);
    acc = _mm512_fmadd_ps(q4k.scale, s, acc);
    return _mm512_fnmadd_ps(q4k.minimum, _mm512_set1_ps(sx), acc);
  }
  if constexpr (QT == kQ4_0) s = _mm512_add_ps(s, _mm512_set1_ps(-8.0f * sx));
  if constexpr (QT == kQ4_G) {
    const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 2 * kCols))));
    s = _mm512_fnmadd_ps(z, _mm512_set1_ps(sx), s);
  }
  acc = _mm512_fmadd_ps(d, s, acc);
  if constexpr (QT == kQ4_1) {
    const __m512 mins = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 2 * kCols)));
    acc = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx), acc);
  }
  return acc;
}

// y[m..m+R, col..col+32) = acc (+ bias), as fp32 or bf16; columns past N are dropped.
template <int R>
TRILLM_Q_TARGET void store_tile(const Gemm& g, int m, int col, const __m512 (&acc)[R][2]) {
  const int64_t elem = g.y_bf16 ? 2 : 4;
  for (int p = 0; p < 2; ++p) {
    const int c0 = col + p * kCols;
    const int cols = std::min(kCols, g.N - c0);
    if (cols <= 0) break;
    __m512 b = _mm512_setzero_ps();
    if (g.bias != nullptr) b = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), g.bias + c0);
    for (int r = 0; r < R; ++r) {
      alignas(64) float out[kCols];
      _mm512_store_ps(out, _mm512_add_ps(acc[r][p], b));
      char* row = static_cast<char*>(g.y) + ((m + r) * g.ldy + c0) * elem;
      if (g.y_bf16) {
        uint16_t* yb = reinterpret_cast<uint16_t*>(row);
        for (int c = 0; c < cols; ++c) yb[c] = to_bf16(out[c]);
      } else {
        std::memcpy(row, out, cols * sizeof(float));
      }
    }
  }
}

// `tile`: blocks ahead whose records it prefetches. SmolLM2-135M's Q4_1 shapes at one row, the
// weights out of cache (a standalone copy of the one-row loop, one thread's CPU time): 0.70-0.81x
// the time of none at 4 or 8 blocks, the next pair's first records prefetched too (within a
// pair only: 0.85-0.97x); in cache no change.
constexpr int kGemvPrefetchBlocks = 4;

// The records kGemvPrefetchBlocks blocks past block b in both of a pair's panels (rec bytes a
// record, nb a panel), past their end the next pair's (its panel p nb records past this one's
// end; a prefetch never faults): at batch 1 the kernels wait on memory, each pair's panels two
// streams the hardware prefetcher follows late, and not across pairs. `tile`, `tile_bf16`
// (cpu_gemm_q_bf16.h) and the AVX2 kernel's `row_direct` (cpu_gemm_q_avx2.h) call it per block.
TRILLM_INLINE void prefetch_gemv_records(const uint8_t* const panel[2], int b, int nb, int rec) {
  const int ahead = b + kGemvPrefetchBlocks + (b + kGemvPrefetchBlocks < nb ? 0 : nb);
  for (int off = 0; off < rec; off += 64)
    for (int p = 0; p < 2; ++p)
      _mm_prefetch(reinterpret_cast<const char*>(panel[p]) + static_cast<int64_t>(ahead) * rec + off,
                   _MM_HINT_T0);
}

// y[0..R, 0..2 panels) = x[0..R, :] . W(panels p0, p1)^T (+ bias).
template <int R, int QT>
TRILLM_Q_TARGET void tile(const Gemm& g, int m, const uint8_t* p0, const uint8_t* p1, int col) {
  constexpr int qbytes = quant_bytes(QT);
  constexpr int rec = qbytes + param_bytes(QT);
  const int nb = g.K / kBlock;
  const float* x = g.x + m * g.ldx;
  const uint8_t* panel[2] = {p0, p1};
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(0xf);
  for (int b = 0; b < nb; ++b) {
    prefetch_gemv_records(panel, b, nb, rec);
    __m512 se[R][2], so[R][2];  // sums over the block's even / odd k: two dependency chains
    for (int r = 0; r < R; ++r)
      se[r][0] = se[r][1] = so[r][0] = so[r][1] = _mm512_setzero_ps();
    const float* xb = x + b * kBlock;
    if constexpr (byte_values(QT)) {
      for (int k = 0; k < kBlock; k += 4) {  // one quad: lane c holds q[c][k .. k + 3]
        if (half_scales(QT) && k == kBlock / 2) {  // the first half has its own scale: fold it in
          for (int p = 0; p < 2; ++p)
            for (int r = 0; r < R; ++r) {
              const uint8_t* params = panel[p] + static_cast<int64_t>(b) * rec + qbytes;
              const __m512 s = _mm512_add_ps(se[r][p], so[r][p]);
              if constexpr (half_min(QT))
                acc[r][p] = add_half_min(acc[r][p], s, g.sx[(m + r) * 2 * nb + 2 * b], params, 0);
              else
                acc[r][p] = add_half(acc[r][p], s, params, 0);
              se[r][p] = so[r][p] = _mm512_setzero_ps();
            }
        }
        for (int p = 0; p < 2; ++p) {
          const __m512i v = _mm512_loadu_si512(panel[p] + static_cast<int64_t>(b) * rec + k * kCols);
          for (int i = 0; i < 4; i += 2) {  // byte i of each lane, sign-extended
            const __m512 w0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24));
            const __m512 w1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16 - 8 * i), 24));
            for (int r = 0; r < R; ++r) {
              se[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * g.ldx + k + i]), w0, se[r][p]);
              so[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * g.ldx + k + i + 1]), w1, so[r][p]);
            }
          }
        }
      }
    } else {
      for (int j = 0; j < kBlock / 2; ++j) {
        if (half_min(QT) && j == kBlock / 4) {  // Q4_KM: the first half's scale and minimum
          for (int p = 0; p < 2; ++p)
            for (int r = 0; r < R; ++r) {
              const uint8_t* params = panel[p] + static_cast<int64_t>(b) * rec + qbytes;
              const __m512 s = _mm512_add_ps(se[r][p], so[r][p]);
              acc[r][p] = add_half_min(acc[r][p], s, g.sx[(m + r) * 2 * nb + 2 * b], params, 0);
              se[r][p] = so[r][p] = _mm512_setzero_ps();
            }
        }
        for (int p = 0; p < 2; ++p) {
          const uint8_t* q = panel[p] + static_cast<int64_t>(b) * rec + j * kCols;
          const __m512i v =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
          __m512i vlo = _mm512_and_si512(v, low4), vhi = _mm512_srli_epi32(v, 4);
          if constexpr (QT == kQ5_KM) {  // the fifth bits of k = 2j, 2j + 1: bytes i0, i0 + 1
            const uint8_t* hb = panel[p] + static_cast<int64_t>(b) * rec + kBlock / 2 * kCols;
            __mmask64 bits;
            std::memcpy(&bits, hb + 8 * (j / 2), 8);
            const __m512i h = _mm512_movm_epi8(bits);
            const __m512i sixteen = _mm512_set1_epi32(16);
            const __m512i h0 = (j & 1) ? _mm512_srli_epi32(h, 16) : h;
            const __m512i h1 = (j & 1) ? _mm512_srli_epi32(h, 24) : _mm512_srli_epi32(h, 8);
            vlo = _mm512_ternarylogic_epi32(vlo, h0, sixteen, 0xF8);  // vlo | (h0 & 16)
            vhi = _mm512_ternarylogic_epi32(vhi, h1, sixteen, 0xF8);
          }
          const __m512 lo = _mm512_cvtepi32_ps(vlo);
          const __m512 hi = _mm512_cvtepi32_ps(vhi);
          for (int r = 0; r < R; ++r) {
            se[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * g.ldx + 2 * j]), lo, se[r][p]);
            so[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * g.ldx + 2 * j + 1]), hi, so[r][p]);
          }
        }
      }
    }
    for (int p = 0; p < 2; ++p) {
      const uint8_t* params = panel[p] + static_cast<int64_t>(b) * rec + qbytes;
      for (int r = 0; r < R; ++r) {
        const float sx = half_min(QT)      ? g.sx[(m + r) * 2 * nb + 2 * b + 1]
                         : byte_values(QT) ? 0.0f
                                           : g.sx[(m + r) * nb + b];
        acc[r][p] = add_block<QT>(acc[r][p], _mm512_add_ps(se[r][p], so[r][p]), sx, params);
      }
    }
  }
  store_tile<R>(g, m, col, acc);
}

#include "cpu_gemm_q_vnni.h"
#include "cpu_gemm_q_vnni_prefill.h"
#include "cpu_gemm_q_bf16.h"
#include "cpu_gemm_q_avx2.h"

enum class Isa { kAvx512, kAvx2 };

// The kernel `linear` runs: AVX-512 where the CPU has it, unless set_isa chose AVX2.
Isa& isa() {
  static Isa chosen = cpu_has_avx512() ? Isa::kAvx512 : Isa::kAvx2;
  return chosen;
}

void set_isa(const std::string& name) {
  if (name == "avx2" && cpu_has_avx2_f16c()) {
    isa() = Isa::kAvx2;
  } else if (name == "avx512" && cpu_has_avx512()) {
    isa() = Isa::kAvx512;
  } else if (name == "avx2" || name == "avx512") {
    throw std::runtime_error("quantized GEMM: this CPU cannot run the " + name + " kernel");
  } else {
    throw std::invalid_argument("quantized GEMM: isa must be 'avx2' or 'avx512'");
  }
}

std::string get_isa() { return isa() == Isa::kAvx512 ? "avx512" : "avx2"; }

bool supported() { return cpu_has_avx512() || cpu_has_avx2_f16c(); }

// int8 activations run on the AVX-512 kernel only (vpdpbusd).
bool int8_supported() { return cpu_has_vnni() && isa() == Isa::kAvx512; }

template <int R, int QT, bool Int8>
void run_tile(const Gemm& g, int m, const uint8_t* p0, const uint8_t* p1, int col) {
  if constexpr (Int8) {
    tile_vnni<R, QT>(g, m, p0, p1, col);
  } else if constexpr (bf16dot_type(QT)) {
    g.xp != nullptr ? tile_bf16<R, QT>(g, m, p0, p1, col) : tile<R, QT>(g, m, p0, p1, col);
  } else {
    tile<R, QT>(g, m, p0, p1, col);
  }
}

template <int QT, bool Int8>
void rows_for_pair(const Gemm& g, int m0, int m1, int pair) {
  const int64_t panel_bytes = static_cast<int64_t>(g.K / kBlock) * record_bytes(QT);
  const uint8_t* p0 = g.packed + 2 * pair * panel_bytes;
  const uint8_t* p1 = p0 + panel_bytes;
  const int col = 2 * pair * kCols;
  int m = m0;
  for (; m + kRows <= m1; m += kRows) run_tile<kRows, QT, Int8>(g, m, p0, p1, col);
  switch (m1 - m) {
    case 1: run_tile<1, QT, Int8>(g, m, p0, p1, col); break;
    case 2: run_tile<2, QT, Int8>(g, m, p0, p1, col); break;
    case 3: run_tile<3, QT, Int8>(g, m, p0, p1, col); break;
    default: break;
  }
}

void run_pair(const Gemm& g, int m0, int m1, int pair) {
  const bool int8 = g.xq != nullptr;
  switch (g.qtype) {
    case kQ4_0: int8 ? rows_for_pair<kQ4_0, true>(g, m0, m1, pair)
                     : rows_for_pair<kQ4_0, false>(g, m0, m1, pair); break;
    case kQ4_1: int8 ? rows_for_pair<kQ4_1, true>(g, m0, m1, pair)
                     : rows_for_pair<kQ4_1, false>(g, m0, m1, pair); break;
    case kQ4_G: int8 ? rows_for_pair<kQ4_G, true>(g, m0, m1, pair)
                     : rows_for_pair<kQ4_G, false>(g, m0, m1, pair); break;
    case kQ4_K: int8 ? rows_for_pair<kQ4_K, true>(g, m0, m1, pair)
                     : rows_for_pair<kQ4_K, false>(g, m0, m1, pair); break;
    case kQ6_K: int8 ? rows_for_pair<kQ6_K, true>(g, m0, m1, pair)
                     : rows_for_pair<kQ6_K, false>(g, m0, m1, pair); break;
    case kQ5_KM: int8 ? rows_for_pair<kQ5_KM, true>(g, m0, m1, pair)
                      : rows_for_pair<kQ5_KM, false>(g, m0, m1, pair); break;
    case kQ4_KM: int8 ? rows_for_pair<kQ4_KM, true>(g, m0, m1, pair)
                      : rows_for_pair<kQ4_KM, false>(g, m0, m1, pair); break;
    default: int8 ? rows_for_pair<kQ8_0, true>(g, m0, m1, pair)
                  : rows_for_pair<kQ8_0, false>(g, m0, m1, pair); break;
  }
}

#include "cpu_gemm_q_q6.h"

// Rows from which the int8 path runs the prefill kernel (cpu_gemm_q_vnni_prefill.h: each panel
// pair unpacked once for all of an item's rows) rather than `tile_vnni` (unpacked per 4 rows).
// Measured at Llama-3.2-1B's shapes, one thread's CPU time (benchmarks/kernels/q_small_m.py):
// for the 4-bit types the unpacking pays from ~12 rows (a 16-row decode step's linears 1.15-1.2x
// faster, 32-48 rows 1.3-1.5x); Q4_KM's and Q5_KM's from 16 rows too (the large shapes 0.80-0.86x
// the time at 16 rows, 0.64-0.82x at 32-48); Q6_KP's, unpacked straight from its records
// (cpu_gemm_q_q6.h), 0.88x at 16 rows for the 128,256-row head, 0.85-0.92x at 16-48 for the
// layers' large shapes. Q8_0's unpacking (a sign flip) gained nothing until the next pair's
// records were prefetched during a pair's products (cpu_gemm_q_vnni_prefill.h's `Prefetch`):
// since, SmolLM2's 49,152 x 576 head at 16 rows 0.73x tile_vnni's time, a 1B step's Q8_0
// linears ~0.9x. Q6_K's 9-bit records (the same flip) stay on `tile_vnni` below 64 rows
// (1.10x its time at 16 rows with the prefetch, ~0.92x at 32: inside the host's noise).
constexpr int int8_unpacked_min_rows(int qtype) {
  return qtype == kQ6_K ? kPrefillMinRows : kInt8UnpackedMinRows;
}

// benchmarks/kernels/q_small_m.py's `--unpacked-from`: every type's int8 rows run the prefill
// kernel from `rows` on (1: always; 64: `tile_vnni` below 64), process-wide; 0 restores each
// type's own. A private hook of the benchmark (it measures both kernels at a row count), not an
// option of the server.
std::atomic<int> unpacked_min_rows_override{0};

void set_int8_unpacked_min_rows(int rows) {
  if (rows < 0 || rows > kPrefillMinRows)
    throw std::invalid_argument("quantized GEMM: unpacked-kernel rows must be 0..64");
  unpacked_min_rows_override.store(rows);
}

int unpacked_min_rows(int qtype) {
  const int chosen = unpacked_min_rows_override.load(std::memory_order_relaxed);
  return chosen > 0 ? chosen : int8_unpacked_min_rows(qtype);
}

void linear(uintptr_t x, bool x_bf16, int M, int K, int64_t ldx, uintptr_t packed, int qtype,
            int N, uintptr_t bias, uintptr_t y, bool y_bf16, int64_t ldy, int num_threads,
            bool int8_activations) {
  static const bool ok = supported();
  if (!ok) throw std::runtime_error("cpu_gemm_q needs a CPU with AVX512F/BW/VL or AVX2/FMA/F16C");
  record_bytes(qtype);  // validates the type
  if (int8_activations && !int8_supported())
    throw std::invalid_argument("quantized GEMM: int8 activations need AVX512-VNNI");
  const bool wide = isa() == Isa::kAvx512;
  if (M < 0 || N <= 0 || K <= 0 || K % kBlock != 0)
    throw std::invalid_argument("quantized GEMM: bad shape (K must be a multiple of 32)");
  if (qtype == kQ6_KP && (K % (kQ6Blocks * kBlock) != 0 || !cpu_has_bf16dot()))
    throw std::invalid_argument(
        "quantized GEMM: Q6_KP needs K a multiple of 256 and a CPU with AVX512-BF16 and VBMI");
  if (M == 0) return;
  py::gil_scoped_release release;
  // x as fp32 rows (bf16 widened exactly) and, for Q4 (Q4_KM, Q5_KM), its per-block (per-half-block)
  // sums: O(M K), small
  // beside the O(M N K) products.
  std::vector<float> widened, sums;
  const float* xf = reinterpret_cast<const float*>(x);
  int64_t ld = ldx;
  if (x_bf16 && !int8_activations) {  // (the int8 path rounds bf16 rows as they are)
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
    widened.resize(static_cast<size_t>(M) * K);
    for (int r = 0; r < M; ++r)
      for (int k = 0; k < K; ++k) widened[static_cast<size_t>(r) * K + k] = from_bf16(xb[r * ldx + k]);
    xf = widened.data();
    ld = K;
  }
  QuantizedRows rows;
  std::vector<uint32_t> pairs_bf16;  // the bf16 path's activations (cpu_gemm_q_bf16.h)
  static const bool bf16dot = cpu_has_bf16dot();
  if (x_bf16 && !int8_activations && wide && bf16dot && (bf16dot_type(qtype) || qtype == kQ6_KP))
    pairs_bf16 = pair_rows(reinterpret_cast<const uint16_t*>(x), ldx, M, K);
  // Under 0.25 MFLOP the caller does it alone; about four runs per thread. (cpu_gemm.cpp's fp32
  // bar, 1 MFLOP, kept SmolLM2-135M's 576 x 576 o_proj, 0.66 MFLOP, on one thread at batch 1:
  // ~33 us a call in Q4_1, the dequantization dearer than fp32's products; on the pool 22 us,
  // benchmarks/engine/step_breakdown.py --threads 2.)
  const int threads = 2LL * M * N * K < 250000 ? 1 : num_threads;
  // (Q6_KP: Q6_K's item, each chunk unpacked straight from Q6_KP's records, cpu_gemm_q_q6.h)
  const bool prefill = prefill_type(qtype) || (qtype == kQ6_KP && wide);
  const bool unpacked = int8_activations && prefill && M >= unpacked_min_rows(qtype);
  if (int8_activations) {
    rows = quantize_rows(reinterpret_cast<const void*>(x), x_bf16, ldx, M, K, threads,
                         unpacked && nibble_order_type(qtype));
  } else if (!byte_values(qtype) && qtype != kQ6_KP) {
    const int span = half_min(qtype) ? kBlock / 2 : kBlock, spans = K / span;
    sums.resize(static_cast<size_t>(M) * spans);
    for (int r = 0; r < M; ++r)
      for (int b = 0; b < spans; ++b) {
        float s = 0.0f;
        for (int k = 0; k < span; ++k) s += xf[r * ld + b * span + k];
        sums[static_cast<size_t>(r) * spans + b] = s;
      }
  }
  const float* sx = int8_activations ? rows.sx.data() : sums.empty() ? nullptr : sums.data();
  Gemm g{xf, ld, sx, int8_activations ? rows.xq.data() : nullptr, rows.dx.data(), rows.qxh.data(),
         pairs_bf16.empty() ? nullptr : pairs_bf16.data(),
         reinterpret_cast<const uint8_t*>(packed), reinterpret_cast<const float*>(bias),
         reinterpret_cast<void*>(y), ldy, M, N, K, qtype, y_bf16};
  const int pairs = num_panels(N) / 2;
  if (unpacked) {
    // items: (block of rows, run of pairs), so that each pair's successor is known and its
    // records prefetched while the pair's products run (cpu_gemm_q_vnni_prefill.h)
    const int blocks = (M + kPrefillRowBlock - 1) / kPrefillRowBlock;
    const int runs = threads <= 1 ? 1 : std::min(pairs, 4 * threads);
    run_items(threads, blocks * runs, [&](int i) {
      const int m0 = i / runs * kPrefillRowBlock, m1 = std::min(M, m0 + kPrefillRowBlock), run = i % runs;
      const int first = static_cast<int>(static_cast<int64_t>(pairs) * run / runs);
      const int last = static_cast<int>(static_cast<int64_t>(pairs) * (run + 1) / runs);
      qtype == kQ6_KP ? run_prefill_item_q6kp(g, m0, m1, first, last)
                      : run_prefill_item(g, m0, m1, first, last);
    });
    return;
  }
  const int row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int runs = threads <= 1 ? 1 : std::min(pairs, 4 * threads);
  run_items(threads, row_blocks * runs, [&](int i) {
    const int rb = i / runs, run = i % runs;
    const int m0 = rb * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
    const int first = static_cast<int>(static_cast<int64_t>(pairs) * run / runs);
    const int last = static_cast<int>(static_cast<int64_t>(pairs) * (run + 1) / runs);
    for (int pair = first; pair < last; ++pair)
      qtype == kQ6_KP ? run_pair_q6kp(g, m0, m1, pair, wide)
      : wide          ? run_pair(g, m0, m1, pair)
                      : run_pair_avx2(g, m0, m1, pair);
  });
}

}  // namespace

void register_cpu_gemm_q(py::module_& m) {
  m.doc() = "GEMM with Q4_0/Q4_1/Q8_0/Q4_K/Q6_K/Q4_G/Q4_KM/Q5_KM block-quantized weights "
            "(AVX-512, or AVX2/FMA/F16C).";
  m.attr("PANEL") = kCols;
  m.attr("BLOCK") = kBlock;
  m.def("supported", &supported, "Whether this CPU has AVX512F/BW/VL or AVX2/FMA/F16C.");
  m.def("supports_int8_activations", &int8_supported,
        "Whether int8 activations run: AVX512-VNNI and the AVX-512 kernel in use.");
  m.def("set_isa", &set_isa, py::arg("isa"),
        "The kernel to use: 'avx512' (the default where the CPU has AVX512F/BW/VL) or 'avx2'.");
  m.def("get_isa", &get_isa, "The kernel in use: 'avx512' or 'avx2'.");
  m.def("num_panels", &num_panels, py::arg("n"));
  m.def("record_bytes", &record_bytes, py::arg("qtype"));
  m.def("_set_int8_unpacked_min_rows", &set_int8_unpacked_min_rows, py::arg("rows"),
        "Benchmarks only: int8 rows from `rows` on run the prefill kernel, every type (0: each "
        "type's own threshold).");
  m.def("supports_q6_kp", &cpu_has_bf16dot,
        "Whether Q6_KP (Q6_K at the file's size) runs: AVX512-BF16 and AVX512-VBMI.");
  trillm_cpu::def_kernel(m, "linear", &linear, py::arg("x"), py::arg("x_bf16"), py::arg("m"), py::arg("k"),
        py::arg("ldx"), py::arg("packed"), py::arg("qtype"), py::arg("n"), py::arg("bias"),
        py::arg("y"), py::arg("y_bf16"), py::arg("ldy"), py::arg("num_threads"),
        py::arg("int8_activations") = false);
}
