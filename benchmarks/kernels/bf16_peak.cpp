// The machine's bf16 multiply peak as trillm's bf16 GEMM would see it: the register block of
// ext/cpu_gemm_bf16.cpp (6 rows x 4 zmm accumulators, vdpbf16ps, weights loaded as 4 zmm a
// k-pair, x broadcast as 32-bit pairs) on data that stays in L1 (64 k-pairs: 16 KiB of
// weights), on `threads` threads at once.
//
//   c++ -O3 -std=c++17 -pthread bf16_peak.cpp -o bf16_peak && ./bf16_peak THREADS SECONDS
//
// Prints one JSON line: the rate in wall time (all threads together) and in each thread's CPU
// time (the best thread-average of the trials): on a shared machine the wall rate falls with
// the load while the CPU-time rate stays the core's own. Built by
// benchmarks/kernels/cpu_gemm_bf16_prefill.py; needs AVX512-BF16 (exit 2 without it).
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
constexpr int kPairs = 64;

double now(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), noinline)) float block(
    const uint16_t* x, const uint16_t* w, long repeats) {
  __m512 acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm512_setzero_ps();
  for (long r = 0; r < repeats; ++r) {
    for (int j = 0; j < kPairs; ++j) {
      __m512bh wv[kVecs];
      for (int v = 0; v < kVecs; ++v)
        wv[v] = (__m512bh)_mm512_loadu_si512(w + (j * kVecs + v) * 32);
      for (int i = 0; i < kRows; ++i) {
        int32_t pair;
        std::memcpy(&pair, x + (i * kPairs + j) * 2, 4);
        const __m512bh xi = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xi, wv[v]);
      }
    }
  }
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) sum = _mm512_add_ps(sum, acc[i][v]);
  return _mm512_reduce_add_ps(sum);
}

}  // namespace

int main(int argc, char** argv) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::fprintf(stderr, "this CPU has no AVX512-BF16\n");
    return 2;
  }
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 1.0;
  const long repeats = 20000;  // ~0.13 s a trial at 230 GFLOP/s a core
  const double flops_per_thread = 2.0 * repeats * kPairs * kRows * kVecs * 32;
  double best_wall = 0, best_cpu = 0;
  const double end = now(CLOCK_MONOTONIC) + seconds;
  for (int trial = 0; trial < 3 || now(CLOCK_MONOTONIC) < end; ++trial) {
    std::vector<std::thread> pool;
    std::vector<double> cpu(threads);
    std::atomic<float> sink{0};
    const double start = now(CLOCK_MONOTONIC);
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        std::vector<uint16_t> x(kRows * kPairs * 2, 0x3f80), w(kPairs * kVecs * 32, 0x3f80);
        const double c0 = now(CLOCK_THREAD_CPUTIME_ID);
        sink.store(block(x.data(), w.data(), repeats));
        cpu[t] = now(CLOCK_THREAD_CPUTIME_ID) - c0;
      });
    for (auto& t : pool) t.join();
    const double wall = now(CLOCK_MONOTONIC) - start;
    double cpu_mean = 0;
    for (double c : cpu) cpu_mean += c / threads;
    best_wall = std::max(best_wall, threads * flops_per_thread / wall);
    best_cpu = std::max(best_cpu, flops_per_thread / cpu_mean);
  }
  std::printf("{\"threads\": %d, \"wall_gflops\": %.1f, \"cpu_gflops_per_thread\": %.1f}\n",
              threads, best_wall / 1e9, best_cpu / 1e9);
  return 0;
}
