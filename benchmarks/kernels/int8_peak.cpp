// The machine's int8 multiply peak as trillm's int8 GEMM would see it: bf16_peak.cpp's twin
// with `vpdpbusd` (64 u8 x s8 products a zmm, summed into 16 int32 lanes) in place of
// `vdpbf16ps` (32 bf16 products): 6 rows x 4 zmm accumulators, weights loaded as 4 zmm a
// quad of k, x broadcast as 32-bit quads, on data that stays in L1 (64 quads: 16 KiB of
// weights), on `threads` threads at once. One "op" is a multiply or an add (2 per product), as
// GFLOP/s counts them for the bf16 GEMM.
//
//   c++ -O3 -std=c++17 -pthread int8_peak.cpp -o int8_peak && ./int8_peak THREADS SECONDS [SCALED 0-3]
//
// SCALED=1 adds the int8 GEMM's unavoidable fp32 step at trillm's activation rounding (one
// scale per half block of 16 k, cpu_gemm_q_vnni.h): every 4 quads each accumulator is
// converted to fp32, scaled by its row's scale and added into an fp32 sum (vcvtdq2ps, vmulps,
// vfmadd231ps), its int32 lanes restarted; the ceiling of a kernel with per-16 scales.
// SCALED=2 is the fp32 step of the int8 prefill kernel (ext/cpu_gemm_q_vnni_prefill.h), whose
// results are exact to its order of roundings: 4 rows x 2 zmm, per half block each sum converted
// and multiplied (first half) or FMA'd (second) by its row's scale, per block of 32 one FMA by
// the columns' weight scale: 3 multiply-unit instructions per 8 `vpdpbusd` (which share those
// units: 8 / 11 of the peak); SCALED=3 adds the minimum's FMA (Q4_1, Q4_G, Q4_K: 8 / 12).
// Prints one JSON line: the rate in wall time (all threads together) and in each thread's CPU
// time (the best thread-average of the trials), in GOP/s. Needs AVX512-VNNI (exit 2 without it).
#include <immintrin.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int kRows = 6;
constexpr int kVecs = 4;
constexpr int kQuads = 64;

double now(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// acc + the products of w's u8 and x's s8 bytes. Inline asm: GCC 12's code for the intrinsic
// in a 6 x 4 block copies each sum through the stack (128 GOP/s a core instead of ~470).
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i dpbusd(__m512i acc,
                                                                                __m512i w,
                                                                                __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), noinline)) float block(
    const int8_t* x, const uint8_t* w, long repeats) {
  __m512i acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm512_setzero_si512();
  for (long r = 0; r < repeats; ++r) {
    for (int j = 0; j < kQuads; ++j) {
      __m512i wv[kVecs];
      for (int v = 0; v < kVecs; ++v) wv[v] = _mm512_loadu_si512(w + (j * kVecs + v) * 64);
      for (int i = 0; i < kRows; ++i) {
        int32_t quad;
        std::memcpy(&quad, x + (i * kQuads + j) * 4, 4);
        const __m512i xi = _mm512_set1_epi32(quad);
        for (int v = 0; v < kVecs; ++v) acc[i][v] = dpbusd(acc[i][v], wv[v], xi);
      }
    }
  }
  __m512i sum = _mm512_setzero_si512();
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) sum = _mm512_add_epi32(sum, acc[i][v]);
  return static_cast<float>(_mm512_reduce_add_epi32(sum));
}

// 3 rows x 4 zmm: 12 int32 sums and 12 fp32 sums in registers (the fp32 ones would not fit
// beside 24 int32 ones).
constexpr int kScaledRows = 3;

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), noinline)) float block_scaled(
    const int8_t* x, const uint8_t* w, const float* dx, long repeats) {
  __m512 acc[kScaledRows][kVecs];
  for (int i = 0; i < kScaledRows; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm512_setzero_ps();
  for (long r = 0; r < repeats; ++r) {
    for (int h = 0; h < kQuads / 4; ++h) {
      __m512i dot[kScaledRows][kVecs];
      for (int i = 0; i < kScaledRows; ++i)
        for (int v = 0; v < kVecs; ++v) dot[i][v] = _mm512_setzero_si512();
      for (int j = 4 * h; j < 4 * h + 4; ++j) {
        __m512i wv[kVecs];
        for (int v = 0; v < kVecs; ++v) wv[v] = _mm512_loadu_si512(w + (j * kVecs + v) * 64);
        for (int i = 0; i < kScaledRows; ++i) {
          int32_t quad;
          std::memcpy(&quad, x + (i * kQuads + j) * 4, 4);
          const __m512i xi = _mm512_set1_epi32(quad);
          for (int v = 0; v < kVecs; ++v) dot[i][v] = dpbusd(dot[i][v], wv[v], xi);
        }
      }
      for (int i = 0; i < kScaledRows; ++i) {
        const __m512 s = _mm512_set1_ps(dx[i * 16 + h]);
        for (int v = 0; v < kVecs; ++v)
          acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][v]), s, acc[i][v]);
      }
    }
  }
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < kScaledRows; ++i)
    for (int v = 0; v < kVecs; ++v) sum = _mm512_add_ps(sum, acc[i][v]);
  return _mm512_reduce_add_ps(sum);
}

// SCALED=2 / 3: the prefill kernel's register block and fp32 step on L1-resident data.
constexpr int kExactRows = 4;
constexpr int kExactVecs = 2;

template <bool kMinimum>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), noinline)) float block_exact(
    const int8_t* x, const uint8_t* w, const float* dx, long repeats) {
  __m512 acc[kExactRows][kExactVecs];
  for (int i = 0; i < kExactRows; ++i)
    for (int v = 0; v < kExactVecs; ++v) acc[i][v] = _mm512_setzero_ps();
  for (long r = 0; r < repeats; ++r) {
    for (int b = 0; b < kQuads / 8; ++b) {
      __m512 first[kExactRows][kExactVecs];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512i dot[kExactRows][kExactVecs];
        for (int i = 0; i < kExactRows; ++i)
          for (int v = 0; v < kExactVecs; ++v) dot[i][v] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const int j = 8 * b + 4 * h + q;
          __m512i wv[kExactVecs];
          for (int v = 0; v < kExactVecs; ++v) wv[v] = _mm512_loadu_si512(w + (j * kExactVecs + v) * 64);
          for (int i = 0; i < kExactRows; ++i) {
            int32_t quad;
            std::memcpy(&quad, x + (i * kQuads + j) * 4, 4);
            const __m512i xi = _mm512_set1_epi32(quad);
            for (int v = 0; v < kExactVecs; ++v) dot[i][v] = dpbusd(dot[i][v], wv[v], xi);
          }
        }
        for (int i = 0; i < kExactRows; ++i) {
          const __m512 d = _mm512_set1_ps(dx[i * 16 + 2 * b + h]);
          for (int v = 0; v < kExactVecs; ++v) {
            const __m512 s = _mm512_cvtepi32_ps(dot[i][v]);
            first[i][v] = h == 0 ? _mm512_mul_ps(s, d) : _mm512_fmadd_ps(s, d, first[i][v]);
          }
        }
      }
      for (int v = 0; v < kExactVecs; ++v) {
        const __m512 scale = _mm512_loadu_ps(dx + 16 * kRows + v * 16);
        for (int i = 0; i < kExactRows; ++i) acc[i][v] = _mm512_fmadd_ps(scale, first[i][v], acc[i][v]);
        if constexpr (kMinimum) {
          const __m512 minimum = _mm512_loadu_ps(dx + 16 * kRows + (2 + v) * 16);
          for (int i = 0; i < kExactRows; ++i)
            acc[i][v] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(dx[i * 16 + 15]), acc[i][v]);
        }
      }
    }
  }
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < kExactRows; ++i)
    for (int v = 0; v < kExactVecs; ++v) sum = _mm512_add_ps(sum, acc[i][v]);
  return _mm512_reduce_add_ps(sum);
}

}  // namespace

int main(int argc, char** argv) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512vnni")) {
    std::fprintf(stderr, "this CPU has no AVX512-VNNI\n");
    return 2;
  }
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 1.0;
  const int scaled = argc > 3 ? std::atoi(argv[3]) : 0;  // 0..3
  const long repeats = 20000;  // ~0.13 s a trial at 470 GOP/s a core
  const int products = scaled >= 2 ? kExactRows * kExactVecs : (scaled ? kScaledRows : kRows) * kVecs;
  const double ops_per_thread = 2.0 * repeats * kQuads * products * 64;
  double best_wall = 0, best_cpu = 0;
  const double end = now(CLOCK_MONOTONIC) + seconds;
  for (int trial = 0; trial < 3 || now(CLOCK_MONOTONIC) < end; ++trial) {
    std::vector<std::thread> pool;
    std::vector<double> cpu(threads);
    std::atomic<float> sink{0};
    const double start = now(CLOCK_MONOTONIC);
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        std::vector<int8_t> x(kRows * kQuads * 4, 1);
        std::vector<uint8_t> w(kQuads * kVecs * 64, 1);
        std::vector<float> dx(kRows * 16 + 4 * 16, 1.0f);
        const double c0 = now(CLOCK_THREAD_CPUTIME_ID);
        sink.store(scaled == 3   ? block_exact<true>(x.data(), w.data(), dx.data(), repeats)
                   : scaled == 2 ? block_exact<false>(x.data(), w.data(), dx.data(), repeats)
                   : scaled      ? block_scaled(x.data(), w.data(), dx.data(), repeats)
                                 : block(x.data(), w.data(), repeats));
        cpu[t] = now(CLOCK_THREAD_CPUTIME_ID) - c0;
      });
    for (auto& t : pool) t.join();
    const double wall = now(CLOCK_MONOTONIC) - start;
    double cpu_mean = 0;
    for (double c : cpu) cpu_mean += c / threads;
    best_wall = std::max(best_wall, threads * ops_per_thread / wall);
    best_cpu = std::max(best_cpu, ops_per_thread / cpu_mean);
  }
  std::printf("{\"threads\": %d, \"scaled\": %d, \"wall_gops\": %.1f, \"cpu_gops_per_thread\": %.1f}\n",
              threads, scaled, best_wall / 1e9, best_cpu / 1e9);
  return 0;
}
