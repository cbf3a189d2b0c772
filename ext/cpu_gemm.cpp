// fp32 GEMM for the CPU linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias), W packed once.
//
// Why not torch's (MKL's) sgemm: each call packs W again, and at the row counts of decode steps
// (one row per running request, tens to a few hundred) that packing is a large part of the
// call; with the weights packed at load time, a register-blocked FMA kernel runs at 1.3-1.7x the
// rate of torch.nn.functional.linear at 8-96 rows on the bench model's shapes (2 threads) and
// 1.1-1.2x at prefill sizes (benchmarks/archive/RESULTS-journal.md, section 2).
//
// Packed layout: N is cut into panels of 16 output columns (the last one zero-padded); panel p
// holds W[16p .. 16p+15, k] for k = 0 .. K-1 as [K][16], so the kernel reads it sequentially.
// A work item is a run of panels for a block of rows; for each panel it walks those rows in
// register blocks. Items run on the calling thread and a small persistent pool
// (ext/cpu_common.h); the GIL is released.
// Two kernels over the same layout, picked at run time: AVX2 + FMA (6 rows x one panel, two
// 8-lane halves) and, where the CPU has AVX-512F, 12 rows x two panels (one 16-lane vector
// each): twice the FMA width on CPUs with two 512-bit FMA units (Intel server cores; on Zen 4
// a 512-bit FMA is two 256-bit halves). Each output is the same sequential chain of FMAs over
// k, from zero, the bias added last, in both kernels: their results are bit-identical, and
// do not depend on the thread count. `available()` is false on CPUs without AVX2/FMA.
#include <pybind11/pybind11.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu_common.h"
#include "cpu_program.h"

namespace py = pybind11;

namespace {

constexpr int kPanel = 16;  // output columns per panel: two 8-lane vectors (one 16-lane)
constexpr int kRows = 6;    // rows of x per AVX2 register block: 6 x 2 accumulators
constexpr int kRows512 = 12;  // rows per AVX-512 register block: 12 x 2 panels accumulators
constexpr int kRowBlock = 192;  // rows of x per work item: 192 x K floats stay in L2

enum class Isa : int { kAvx2 = 0, kAvx512 = 1 };

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// y[0..R, 0..16) = x[0..R, :] . panel (+ bias), stored to y (row stride ldy) or, for the last
// panel when N is not a multiple of 16, only its first `cols` columns.
template <int R>
inline __attribute__((always_inline)) void block(const float* x, int64_t ldx, const float* panel,
                                                 int K, const float* bias, float* y,
                                                 int64_t ldy, int cols) {
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    // 16 k-steps (1 KiB) ahead: the panel streams in from memory on the first row block.
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 16) * kPanel), _MM_HINT_T0);
    for (int i = 0; i < R; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xi, w1, acc[i][1]);
    }
  }
  if (bias != nullptr) {
    alignas(32) float b[kPanel] = {};
    std::memcpy(b, bias, sizeof(float) * cols);
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm256_add_ps(acc[i][0], b0);
      acc[i][1] = _mm256_add_ps(acc[i][1], b1);
    }
  }
  for (int i = 0; i < R; ++i) {
    if (cols == kPanel) {
      _mm256_storeu_ps(y + i * ldy, acc[i][0]);
      _mm256_storeu_ps(y + i * ldy + 8, acc[i][1]);
    } else {
      alignas(32) float row[kPanel];
      _mm256_store_ps(row, acc[i][0]);
      _mm256_store_ps(row + 8, acc[i][1]);
      std::memcpy(y + i * ldy, row, sizeof(float) * cols);
    }
  }
}

struct Gemm {
  const float* x;
  int64_t ldx;
  const float* packed;
  const float* bias;  // null: none
  float* y;
  int64_t ldy;
  int M, N, K;
};

void panels(const Gemm& g, int first, int last) {
  for (int p = first; p < last; ++p) {
    const float* panel = g.packed + static_cast<int64_t>(p) * g.K * kPanel;
    const int col = p * kPanel;
    const int cols = std::min(kPanel, g.N - col);
    const float* bias = g.bias == nullptr ? nullptr : g.bias + col;
    int m = 0;
    for (; m + kRows <= g.M; m += kRows)
      block<kRows>(g.x + m * g.ldx, g.ldx, panel, g.K, bias, g.y + m * g.ldy + col, g.ldy, cols);
    const float* x = g.x + m * g.ldx;
    float* y = g.y + m * g.ldy + col;
    switch (g.M - m) {
      case 1: block<1>(x, g.ldx, panel, g.K, bias, y, g.ldy, cols); break;
      case 2: block<2>(x, g.ldx, panel, g.K, bias, y, g.ldy, cols); break;
      case 3: block<3>(x, g.ldx, panel, g.K, bias, y, g.ldy, cols); break;
      case 4: block<4>(x, g.ldx, panel, g.K, bias, y, g.ldy, cols); break;
      case 5: block<5>(x, g.ldx, panel, g.K, bias, y, g.ldy, cols); break;
      default: break;
    }
  }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,fma")

// y[0..R, P panels) = x[0..R, :] . panels (+ bias): P (1 or 2) panels of 16 columns, 16 k apart
// in memory by K * 16 floats; `cols` live columns in the last panel.
template <int R, int P>
inline __attribute__((always_inline)) void block512(const float* x, int64_t ldx,
                                                    const float* panel, int K,
                                                    const float* bias, float* y, int64_t ldy,
                                                    int cols) {
  __m512 acc[R][P];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < P; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t stride = static_cast<int64_t>(K) * kPanel;  // next panel
  for (int k = 0; k < K; ++k) {
    __m512 w[P];
    for (int j = 0; j < P; ++j) {
      w[j] = _mm512_loadu_ps(panel + j * stride + k * kPanel);
      _mm_prefetch(reinterpret_cast<const char*>(panel + j * stride + (k + 16) * kPanel),
                   _MM_HINT_T0);
    }
    for (int i = 0; i < R; ++i) {
      const __m512 xi = _mm512_set1_ps(x[i * ldx + k]);
      for (int j = 0; j < P; ++j) acc[i][j] = _mm512_fmadd_ps(xi, w[j], acc[i][j]);
    }
  }
  const __mmask16 last = static_cast<__mmask16>((1u << cols) - 1u);  // cols in 1..16
  for (int j = 0; j < P; ++j) {
    const __mmask16 live = j == P - 1 ? last : static_cast<__mmask16>(0xFFFF);
    if (bias != nullptr) {
      const __m512 b = _mm512_maskz_loadu_ps(live, bias + j * kPanel);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_add_ps(acc[i][j], b);
    }
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(y + i * ldy + j * kPanel, live, acc[i][j]);
  }
}

template <int P>
void rows512(const Gemm& g, const float* panel, const float* bias, int col, int cols) {
  int m = 0;
  for (; m + kRows512 <= g.M; m += kRows512)
    block512<kRows512, P>(g.x + m * g.ldx, g.ldx, panel, g.K, bias, g.y + m * g.ldy + col,
                          g.ldy, cols);
  const float* x = g.x + m * g.ldx;
  float* y = g.y + m * g.ldy + col;
  switch (g.M - m) {
#define TRILLM_ROWS(r) \
  case r: block512<r, P>(x, g.ldx, panel, g.K, bias, y, g.ldy, cols); break;
    TRILLM_ROWS(1) TRILLM_ROWS(2) TRILLM_ROWS(3) TRILLM_ROWS(4) TRILLM_ROWS(5) TRILLM_ROWS(6)
    TRILLM_ROWS(7) TRILLM_ROWS(8) TRILLM_ROWS(9) TRILLM_ROWS(10) TRILLM_ROWS(11)
#undef TRILLM_ROWS
    default: break;
  }
}

// Panels [first, last) two at a time (an odd one left alone), every row of g.
void panels512(const Gemm& g, int first, int last) {
  for (int p = first; p < last; p += 2) {
    const int col = p * kPanel;
    const float* panel = g.packed + static_cast<int64_t>(p) * g.K * kPanel;
    const float* bias = g.bias == nullptr ? nullptr : g.bias + col;
    if (p + 1 < last) {
      rows512<2>(g, panel, bias, col, std::min(kPanel, g.N - col - kPanel));
    } else {
      rows512<1>(g, panel, bias, col, std::min(kPanel, g.N - col));
    }
  }
}

#pragma GCC pop_options

bool cpu_has_avx512f() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
}

// The kernel `linear` uses: AVX-512 where the CPU has it, unless set_isa chose AVX2.
Isa& isa() {
  static Isa chosen = cpu_has_avx512f() ? Isa::kAvx512 : Isa::kAvx2;
  return chosen;
}

void set_isa(const std::string& name) {
  if (name == "avx2") {
    isa() = Isa::kAvx2;
  } else if (name == "avx512") {
    if (!cpu_has_avx512f()) throw std::runtime_error("this CPU has no AVX-512F");
    isa() = Isa::kAvx512;
  } else {
    throw std::invalid_argument("isa must be 'avx2' or 'avx512'");
  }
}

std::string get_isa() { return isa() == Isa::kAvx512 ? "avx512" : "avx2"; }

int num_panels(int N) { return (N + kPanel - 1) / kPanel; }

// W [N, K] (row stride ldw) -> packed [num_panels(N) * K * 16].
void pack(uintptr_t weight, int N, int K, int64_t ldw, uintptr_t packed) {
  if (N <= 0 || K <= 0) throw std::invalid_argument("N and K must be positive");
  const float* w = reinterpret_cast<const float*>(weight);
  float* out = reinterpret_cast<float*>(packed);
  py::gil_scoped_release release;
  for (int p = 0; p < num_panels(N); ++p) {
    float* panel = out + static_cast<int64_t>(p) * K * kPanel;
    for (int c = 0; c < kPanel; ++c) {
      const int n = p * kPanel + c;
      for (int k = 0; k < K; ++k) panel[k * kPanel + c] = n < N ? w[n * ldw + k] : 0.0f;
    }
  }
}

void linear(uintptr_t x, int M, int K, int64_t ldx, uintptr_t packed, int N, uintptr_t bias,
            uintptr_t y, int64_t ldy, int num_threads) {
  static const bool avx2 = cpu_has_avx2();
  if (!avx2) throw std::runtime_error("cpu_gemm needs a CPU with AVX2 and FMA");
  if (M < 0 || N <= 0 || K <= 0) throw std::invalid_argument("bad GEMM shape");
  if (M == 0) return;
  const Gemm g{reinterpret_cast<const float*>(x), ldx, reinterpret_cast<const float*>(packed),
               reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(y), ldy, M, N, K};
  const int total = num_panels(N);
  // Work items: (block of up to kRowBlock rows, run of panels), row-block major. A row block of
  // x stays in L2 while the panels stream past it; the runs are about four per thread (uneven
  // row blocks and a busy core even out). Under 0.25 MFLOP the caller does it alone: waking the
  // pool costs more. (At 1 MFLOP, SmolLM2-135M's 576 x 576 o_proj, 0.66 MFLOP, ran on the
  // caller alone at batch 1: 82.5 us a call; on the pool 61.0-68.9 us,
  // benchmarks/engine/step_breakdown.py --dtype float32 --threads 2.)
  const int threads = 2LL * M * N * K < 250000 ? 1 : num_threads;
  const int row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int runs = threads <= 1 ? 1 : std::min(total, 4 * threads);
  const bool wide = isa() == Isa::kAvx512;
  auto item = [&](int i) {
    const int rb = i / runs, run = i % runs;
    Gemm part = g;
    const int row0 = rb * kRowBlock;
    part.M = std::min(kRowBlock, M - row0);
    part.x += row0 * ldx;
    part.y += row0 * ldy;
    // The AVX-512 kernel takes panels in pairs: runs start on even panels.
    const int64_t units = wide ? (total + 1) / 2 : total, scale = wide ? 2 : 1;
    const int first = static_cast<int>(std::min<int64_t>(total, units * run / runs * scale));
    const int last =
        static_cast<int>(std::min<int64_t>(total, units * (run + 1) / runs * scale));
    if (wide) {
      panels512(part, first, last);
    } else {
      panels(part, first, last);
    }
  };
  py::gil_scoped_release release;
  run_items(threads, row_blocks * runs, item);
}

}  // namespace

void register_cpu_gemm(py::module_& m) {
  m.doc() = "fp32 GEMM with weights packed once, for the CPU linear layers.";
  m.attr("PANEL") = kPanel;
  m.def("supported", &cpu_has_avx2, "Whether this CPU has AVX2 and FMA.");
  m.def("set_isa", &set_isa, py::arg("isa"),
        "The kernel to use: 'avx512' (the default where the CPU has AVX-512F) or 'avx2'; both "
        "give bit-identical results (benchmarks and tests compare them).");
  m.def("get_isa", &get_isa, "The kernel in use: 'avx512' or 'avx2'.");
  m.def("num_panels", &num_panels, py::arg("n"));
  m.def("pack", &pack, py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("ldw"),
        py::arg("packed"));
  trillm_cpu::def_kernel(m, "linear", &linear, py::arg("x"), py::arg("m"), py::arg("k"), py::arg("ldx"),
        py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("y"), py::arg("ldy"),
        py::arg("num_threads"));
}
