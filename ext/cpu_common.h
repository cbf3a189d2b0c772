// Shared by the native CPU kernels of trillm._ext.cpu_kernels (cpu_attention.cpp, cpu_gemm.cpp,
// cpu_ops.cpp): the process's thread pool, and 8-lane fp32 vector helpers (GCC/Clang vector
// extensions) with bf16 load/store, those in an anonymous namespace (a copy per source file).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

// The thread pool is one per process, shared by every kernel of the module (ext/cpu_kernels.cpp
// defines pool_for): with a pool per kernel family, one family's threads would poll on the
// cores while the next family's work.
namespace trillm_cpu {

// How long a pool thread (and the caller, waiting for the workers) polls before it sleeps on
// the condition variable: 20,000 pause instructions, ~0.5 ms. A forward pass calls the kernels
// every few tens of microseconds, each futex wake-up costs about as much on this VM; with the
// poll a decode step (batch 64, bench model) took 38.6-53.5 ms against 42.9-57.0 without it,
// measured alternately.
constexpr int kPoolSpinPauses = 20000;

// ------------------------------------------------------------------------------------------
// Thread pool: workers poll briefly, then sleep on a condition variable between calls; the
// caller takes items too.
//
// A call's items are claimed from one word, (call number << 32) | items left, by compare-and-
// swap: a worker claims an item of the call it woke for only while that call is still the
// current one and has items left. So the caller waits for the items, not for the workers: a
// worker still asleep or descheduled when the caller (and any awake worker) has run every item
// can no longer take one, and the call returns without it. Waiting for every worker to check in
// (as this pool did) cost a scheduler slice each call on a busy host: a batch-1 decode step of
// SmolLM2-135M Q4_1 (~150 pooled calls, 2 threads, 1-min load 14-27) took 495 ms of wall time
// with 2 threads against 79 with 1.

class ThreadPool {
 public:
  explicit ThreadPool(int num_workers) : pid_(getpid()) {
    for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { loop(); });
  }

  int num_workers() const { return static_cast<int>(workers_.size()); }
  pid_t pid() const { return pid_; }

  // The caller's word that no call follows soon (a model step has ended): the workers polling
  // for the next call stop and sleep now instead of holding a core for the rest of their poll,
  // which on a 2-core machine kept one core from the engine's and the HTTP server's work
  // between two steps, all of it on a batch-1 token's path. The next run() wakes them.
  void park() { parked_.store(true, std::memory_order_release); }

  // Runs fn(0) .. fn(num_items - 1) on the workers and the calling thread; returns when all
  // are done. An item that throws (std::bad_alloc of a kernel's scratch buffer) does not end
  // the call early: every item runs, then the first exception is rethrown on the caller's
  // thread (thrown on a worker it would have ended the process; on the caller it would have
  // left the workers running items of a call that had returned).
  void run(int num_items, const std::function<void(int)>& fn) {
    if (num_items <= 0) return;
    std::lock_guard<std::mutex> one_call(run_mu_);  // callers on several threads take turns
    {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = nullptr;
      fn_.store(&fn, std::memory_order_relaxed);
      num_items_.store(num_items, std::memory_order_relaxed);
      done_items_.store(0, std::memory_order_relaxed);
      parked_.store(false, std::memory_order_relaxed);
      call_ += 1;  // 32 bits, wrapping: a worker would have to sleep through 2^32 calls to err
      claim_.store((static_cast<uint64_t>(call_) << 32) | static_cast<uint32_t>(num_items), std::memory_order_release);
    }
    start_.notify_all();
    take_items(call_);
    if (!spin_until([&] { return done_items_.load(std::memory_order_acquire) == num_items; })) {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, [&] { return done_items_.load() == num_items; });
    }
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::swap(error, error_);
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  // Runs items of call `call` while it is the current call and has items left. Every item runs
  // once: the compare-and-swap that takes the count of items left from n to n - 1 runs item
  // num_items - n. fn_ and num_items_ are read after the claim word showed `call`; a claim
  // that succeeds proves the call was still running (its items not all claimed), so they
  // were still that call's.
  void take_items(uint64_t call) {
    const std::function<void(int)>* fn = fn_.load(std::memory_order_relaxed);
    const int num_items = num_items_.load(std::memory_order_relaxed);
    uint64_t word = claim_.load(std::memory_order_acquire);
    while ((word >> 32) == call && static_cast<uint32_t>(word) != 0) {
      if (!claim_.compare_exchange_weak(word, word - 1, std::memory_order_acq_rel)) continue;
      try {
        (*fn)(num_items - static_cast<int>(static_cast<uint32_t>(word)));
      } catch (...) {  // kept for the caller (run), the item counted as done
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_items_.fetch_add(1, std::memory_order_acq_rel) + 1 == num_items) {
        // The lock orders this with the caller's check-then-sleep: no lost wake-up.
        { std::lock_guard<std::mutex> lock(mu_); }
        done_.notify_one();
      }
      word = claim_.load(std::memory_order_acquire);
    }
  }

  // Polls `ready` for kPoolSpinPauses pauses; true once it holds.
  template <typename F>
  static bool spin_until(F ready) {
    for (int i = 0; i < kPoolSpinPauses; ++i) {
      if (ready()) return true;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    return ready();
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      auto current = [this] { return claim_.load(std::memory_order_acquire) >> 32; };
      const auto parked = [this] { return parked_.load(std::memory_order_acquire); };
      if (!spin_until([&] { return current() != seen || parked(); }) || current() == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return current() != seen; });
      }
      seen = current();
      take_items(seen);
    }
  }

  pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable start_, done_;
  uint32_t call_ = 0;  // the caller's count of calls (under run_mu_)
  std::atomic<uint64_t> claim_{0};
  std::atomic<const std::function<void(int)>*> fn_{nullptr};
  std::atomic<int> num_items_{0};
  std::atomic<int> done_items_{0};
  std::atomic<bool> parked_{false};  // park() since the last call began
  std::exception_ptr error_;  // the call's first exception from an item (under mu_)
};

// The process's pool for num_threads threads (the caller included): one per thread count, made
// on the count's first use and kept (ext/cpu_kernels.cpp), all made again after a fork (the
// child has none of the parent's threads).
ThreadPool* pool_for(int num_threads);

// park() on every pool of the process (ext/cpu_kernels.cpp).
void park_pools();

}  // namespace trillm_cpu

namespace {

using trillm_cpu::pool_for;

// fn(0) .. fn(num_items - 1): on the calling thread alone when one thread or one item would
// do, else on the pool (the caller taking items too).
template <typename F>
void run_items(int num_threads, int num_items, F&& fn) {
  if (num_threads <= 1 || num_items <= 1) {
    for (int i = 0; i < num_items; ++i) fn(i);
    return;
  }
  const std::function<void(int)> item = fn;
  pool_for(num_threads)->run(num_items, item);
}

// ------------------------------------------------------------------------------------------
// 8 fp32 lanes (GCC/Clang vector extensions): SSE pairs in the generic build, one AVX2 register
// in a function compiled with __attribute__((target("avx2,fma"))) (chosen at run time).

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

#define TRILLM_INLINE inline __attribute__((always_inline))

struct Bf16 {
  uint16_t bits;
};

// fp8 e4m3 (KV caches of --kv-cache-dtype fp8): sign, 4 exponent bits (bias 7), 3 mantissa
// bits; no infinities, 0x7f / 0xff NaN (never written: stores saturate at +-448).
struct Fp8 {
  uint8_t bits;
};

TRILLM_INLINE void store(float* p, float x) { *p = x; }
TRILLM_INLINE void store(Bf16* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p->bits = static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, like torch
    p->bits = static_cast<uint16_t>(u >> 16);
  }
}

TRILLM_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// Eight e4m3 values, exactly: a normal one is (byte & 0x7f) << 20 plus 120 << 23 as fp32 bits,
// a subnormal one (exponent 0) is its mantissa times 2^-9.
TRILLM_INLINE v8f load8(const Fp8* p) {
  uint8_t b[8];
  std::memcpy(b, p, 8);
  const v8i x = v8i{b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]};
  const v8i mag = x & 0x7f;
  const v8i normal_bits = (mag << 20) + (120 << 23);
  v8f normal;
  std::memcpy(&normal, &normal_bits, sizeof(normal));
  const v8f sub = __builtin_convertvector(mag, v8f) * 0.001953125f;  // m * 2^-9
  const v8i use_sub = mag < 8;
  v8i bits;
  v8i sub_bits;
  std::memcpy(&bits, &normal, sizeof(bits));
  std::memcpy(&sub_bits, &sub, sizeof(sub_bits));
  bits = (use_sub & sub_bits) | (~use_sub & bits);
  bits |= (x & 0x80) << 24;
  v8f out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

TRILLM_INLINE v8f load8(const Bf16* p) {
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  v8u32 w = __builtin_convertvector(h, v8u32) << 16;
  v8f v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

TRILLM_INLINE void store(Fp8* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = std::fabs(x);
  if (!(a == a)) {
    p->bits = 0x7f;  // NaN stays NaN
  } else if (a >= 464.0f) {
    p->bits = sign | 0x7e;  // saturate: 448 and the midpoint to the next (480) and beyond
  } else if (a < 0.015625f) {
    // subnormal range (below 2^-6): multiples of 2^-9, rounded to nearest even; 8 * 2^-9 is
    // 2^-6, whose code (exponent 1, mantissa 0) is 8 as well
    p->bits = sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  } else {
    uint32_t m;
    std::memcpy(&m, &a, 4);
    m += 0x7ffffu + ((m >> 20) & 1u);  // round to 3 mantissa bits, nearest even
    const int e = static_cast<int>(m >> 23) - 127 + 7;
    const int code = (e << 3) | static_cast<int>((m >> 20) & 7u);
    p->bits = sign | static_cast<uint8_t>(std::min(code, 0x7e));
  }
}

TRILLM_INLINE v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// Each lane rounded to bf16 (nearest even, like torch's cast) and widened back: where a bf16
// reference rounds an intermediate (transformers' bf16 attention scores), so do the kernels.
TRILLM_INLINE v8f round_bf16(v8f x) {
  v8u32 u;
  std::memcpy(&u, &x, sizeof(u));
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

TRILLM_INLINE float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#if defined(__clang__)
#define TRILLM_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TRILLM_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// {sum of a[0], ..., sum of a[7]}: a transposing add tree (in-lane shuffles, then one swap of
// 128-bit halves) instead of eight separate horizontal sums.
TRILLM_INLINE v8f sum_lanes8(const v8f* a) {
  v8f b[4], c[2];
  for (int i = 0; i < 4; ++i) {
    const v8f x = a[2 * i], y = a[2 * i + 1];
    b[i] = TRILLM_SHUFFLE(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           TRILLM_SHUFFLE(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const v8f x = b[2 * i], y = b[2 * i + 1];
    c[i] = TRILLM_SHUFFLE(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           TRILLM_SHUFFLE(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return TRILLM_SHUFFLE(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         TRILLM_SHUFFLE(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

TRILLM_INLINE float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x <= 0 (scores minus their running max), lanes equal to -inf give exactly 0.
// Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial; ~1 ulp.
TRILLM_INLINE v8f exp_nonpositive(v8f x) {
  const v8i live = x != splat(-std::numeric_limits<float>::infinity());
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  v8f fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8i n = __builtin_convertvector(fx, v8i);  // truncates toward zero; floor below
  v8f nf = __builtin_convertvector(n, v8f);
  n += nf > fx ? v8i{-1, -1, -1, -1, -1, -1, -1, -1} : v8i{0, 0, 0, 0, 0, 0, 0, 0};
  nf = __builtin_convertvector(n, v8f);
  v8f r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  v8f y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * r * r + r + splat(1.0f);
  v8i bits = (n + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  v8i out;
  v8f e = y * scale;
  std::memcpy(&out, &e, sizeof(out));
  out &= live;
  std::memcpy(&e, &out, sizeof(e));
  return e;
}

// Whether the kernels' AVX2/FMA builds may run here (each module picks them at run time).
inline bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// Whether AVX512F/BW/VL and AVX512-BF16 (vdpbf16ps) run here: the bf16 GEMMs and the
// attention's vdpbf16ps kernels pick it at run time.
inline bool cpu_has_avx512bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace
