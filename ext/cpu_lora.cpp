// Batched LoRA on CPU (Punica-style shrink / expand with a per-token adapter slot):
//   shrink  buf[t, :] = scale[s] * (x[t, :] . A[s]^T)     s = slots[t]; buf fp32 [T, R]
//   expand  y[t, :] += buf[t, :] . Bt[s]                  (Bt[s] = B[s]^T, [R, out])
// Tokens whose slot is -1 (base model) get a zero buf row and keep their y row.
//
// Layouts: x [T, in] and y [T, out] rows ldx / ldy apart; A [L, R, in] and Bt [L, R, out]
// contiguous, of x's dtype (fp32 or bf16); scales [L] fp32; slots [T] int64. Math in fp32; y is
// rounded to its dtype once, after the whole delta is added.
//
// The tokens are grouped by slot (a counting sort, O(T + L)) and cut into blocks of up to 4
// tokens of one slot: a block reads each row of its adapter's A (shrink) or Bt (expand) once for
// all its tokens, as a small GEMM instead of one GEMV per token. Blocks (and, for the expand,
// runs of output columns) are the work items of the shared thread pool; a token's result never
// depends on the split. Each kernel is compiled twice: for AVX-512 (16 fp32 lanes in one
// register, chosen at run time) and generic (the same vector code lowered to SSE).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_program.h"

namespace py = pybind11;

namespace {

constexpr int kTok = 4;            // tokens of one slot per block
constexpr int64_t kOutRun = 512;   // output columns per expand work item
constexpr int64_t kInline = 1 << 18;  // below this many multiply-adds a call runs inline

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

TRILLM_INLINE v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
TRILLM_INLINE v16f load16(const Bf16* p) {
  v16u16 h;
  std::memcpy(&h, p, sizeof(h));
  const v16u32 w = __builtin_convertvector(h, v16u32) << 16;
  v16f v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
TRILLM_INLINE float to_float(float x) { return x; }
TRILLM_INLINE float to_float(Bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
TRILLM_INLINE float hsum16(v16f v) {
  float s[16];
  std::memcpy(s, &v, sizeof(s));
  float lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = s[i] + s[i + 8];
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}
// y[0..16) += acc, rounded to T once.
template <typename T>
TRILLM_INLINE void add_store16(T* y, v16f acc) {
  const v16f sum = load16(y) + acc;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(y, &sum, sizeof(sum));
  } else {
    float s[16];
    std::memcpy(s, &sum, sizeof(s));
    for (int i = 0; i < 16; ++i) store(y + i, s[i]);
  }
}

struct Block {
  int64_t slot;
  int64_t begin, end;  // into the slot-sorted token order
};

template <typename T>
struct Shrink {
  const T* x;
  int64_t ldx;
  const T* a;
  const float* scales;
  float* buf;
  int64_t in, rank;
};

template <typename T>
struct Expand {
  T* y;
  int64_t ldy;
  const float* buf;
  const T* bt;
  int64_t out, rank;
};

// buf rows of N tokens of one slot.
template <typename T, int N>
TRILLM_INLINE void shrink_block(const Shrink<T>& s, int64_t slot, const int64_t* tokens) {
  const T* x[N];
  for (int i = 0; i < N; ++i) x[i] = s.x + tokens[i] * s.ldx;
  const float scale = s.scales[slot];
  for (int64_t r = 0; r < s.rank; ++r) {
    const T* a = s.a + (slot * s.rank + r) * s.in;
    v16f acc[N] = {};
    int64_t k = 0;
    for (; k + 16 <= s.in; k += 16) {
      const v16f w = load16(a + k);
      for (int i = 0; i < N; ++i) acc[i] += load16(x[i] + k) * w;
    }
    float tail[N] = {};
    for (; k < s.in; ++k) {
      const float w = to_float(a[k]);
      for (int i = 0; i < N; ++i) tail[i] += to_float(x[i][k]) * w;
    }
    for (int i = 0; i < N; ++i) s.buf[tokens[i] * s.rank + r] = scale * (hsum16(acc[i]) + tail[i]);
  }
}

// y rows of N tokens of one slot, output columns [o0, o1).
template <typename T, int N>
TRILLM_INLINE void expand_block(const Expand<T>& e, int64_t slot, const int64_t* tokens,
                                int64_t o0, int64_t o1) {
  const T* bt = e.bt + slot * e.rank * e.out;
  const float* c[N];
  for (int i = 0; i < N; ++i) c[i] = e.buf + tokens[i] * e.rank;
  int64_t o = o0;
  for (; o + 32 <= o1; o += 32) {
    v16f acc[N][2] = {};
    for (int64_t r = 0; r < e.rank; ++r) {
      const T* w = bt + r * e.out + o;
      const v16f w0 = load16(w), w1 = load16(w + 16);
      for (int i = 0; i < N; ++i) {
        const float ci = c[i][r];
        const v16f cv = v16f{} + ci;
        acc[i][0] += cv * w0;
        acc[i][1] += cv * w1;
      }
    }
    for (int i = 0; i < N; ++i) {
      T* y = e.y + tokens[i] * e.ldy + o;
      add_store16(y, acc[i][0]);
      add_store16(y + 16, acc[i][1]);
    }
  }
  for (; o < o1; ++o) {  // the last < 32 columns
    for (int i = 0; i < N; ++i) {
      float sum = 0.0f;
      for (int64_t r = 0; r < e.rank; ++r) sum += c[i][r] * to_float(bt[r * e.out + o]);
      T* y = e.y + tokens[i] * e.ldy + o;
      store(y, to_float(*y) + sum);
    }
  }
}

template <typename T>
TRILLM_INLINE void shrink_item(const Shrink<T>& s, const Block& b, const int64_t* order) {
  const int64_t* t = order + b.begin;
  switch (b.end - b.begin) {
    case 1: shrink_block<T, 1>(s, b.slot, t); break;
    case 2: shrink_block<T, 2>(s, b.slot, t); break;
    case 3: shrink_block<T, 3>(s, b.slot, t); break;
    default: shrink_block<T, 4>(s, b.slot, t); break;
  }
}

template <typename T>
TRILLM_INLINE void expand_item(const Expand<T>& e, const Block& b, const int64_t* order,
                               int64_t o0, int64_t o1) {
  const int64_t* t = order + b.begin;
  switch (b.end - b.begin) {
    case 1: expand_block<T, 1>(e, b.slot, t, o0, o1); break;
    case 2: expand_block<T, 2>(e, b.slot, t, o0, o1); break;
    case 3: expand_block<T, 3>(e, b.slot, t, o0, o1); break;
    default: expand_block<T, 4>(e, b.slot, t, o0, o1); break;
  }
}

template <typename T>
void shrink_generic(const Shrink<T>& s, const Block& b, const int64_t* order) {
  shrink_item<T>(s, b, order);
}
template <typename T>
void expand_generic(const Expand<T>& e, const Block& b, const int64_t* order, int64_t o0,
                    int64_t o1) {
  expand_item<T>(e, b, order, o0, o1);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define TRILLM_LORA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
template <typename T>
TRILLM_LORA_TARGET void shrink_avx512(const Shrink<T>& s, const Block& b, const int64_t* order) {
  shrink_item<T>(s, b, order);
}
template <typename T>
TRILLM_LORA_TARGET void expand_avx512(const Expand<T>& e, const Block& b, const int64_t* order,
                                      int64_t o0, int64_t o1) {
  expand_item<T>(e, b, order, o0, o1);
}
#endif

bool cpu_has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// Whether the AVX-512 build runs (set_use_avx512(False) forces the generic one, for the tests).
bool g_use_avx512 = cpu_has_avx512();

void set_use_avx512(bool on) {
  if (on && !cpu_has_avx512()) throw std::runtime_error("this CPU has no AVX-512F/BW/VL");
  g_use_avx512 = on;
}

// The tokens with a slot, sorted by slot (stable), cut into blocks of <= kTok of one slot.
struct Plan {
  std::vector<int64_t> order;
  std::vector<Block> blocks;
};

Plan plan_blocks(const int64_t* slots, int64_t num_tokens, int64_t num_slots) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < -1 || slots[t] >= num_slots)
      throw std::invalid_argument("token " + std::to_string(t) + " has slot " +
                                  std::to_string(slots[t]) + ", outside -1 .. " +
                                  std::to_string(num_slots - 1));
  }
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= 0) ++start[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  Plan plan;
  plan.order.resize(start[num_slots]);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= 0) plan.order[next[slots[t]]++] = t;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t b = start[s]; b < start[s + 1]; b += kTok)
      plan.blocks.push_back(Block{s, b, std::min(b + kTok, start[s + 1])});
  return plan;
}

void check_dims(int64_t num_tokens, int64_t width, int64_t rank, int64_t num_slots) {
  if (num_tokens < 0 || width <= 0 || rank <= 0 || num_slots <= 0)
    throw std::invalid_argument("need num_tokens >= 0 and positive width, rank and num_slots");
}

template <typename T>
void run_shrink(const Shrink<T>& s, const Plan& plan, int num_threads) {
  auto fn = &shrink_generic<T>;
#if defined(__x86_64__) && defined(__GNUC__)
  if (g_use_avx512) fn = &shrink_avx512<T>;
#endif
  const int64_t work = static_cast<int64_t>(plan.order.size()) * s.rank * s.in;
  const int threads = work < kInline ? 1 : num_threads;
  run_items(threads, static_cast<int>(plan.blocks.size()),
            [&](int i) { fn(s, plan.blocks[i], plan.order.data()); });
}

template <typename T>
void run_expand(const Expand<T>& e, const Plan& plan, int num_threads) {
  auto fn = &expand_generic<T>;
#if defined(__x86_64__) && defined(__GNUC__)
  if (g_use_avx512) fn = &expand_avx512<T>;
#endif
  const int64_t work = static_cast<int64_t>(plan.order.size()) * e.rank * e.out;
  const int threads = work < kInline ? 1 : num_threads;
  const int64_t runs = threads <= 1 ? 1 : (e.out + kOutRun - 1) / kOutRun;
  const int64_t items = static_cast<int64_t>(plan.blocks.size()) * runs;
  run_items(threads, static_cast<int>(items), [&](int i) {
    const int64_t run = i % runs;
    const int64_t o0 = e.out * run / runs / 32 * 32;  // runs start on 32-column boundaries
    const int64_t o1 = run + 1 == runs ? e.out : e.out * (run + 1) / runs / 32 * 32;
    fn(e, plan.blocks[i / runs], plan.order.data(), o0, o1);
  });
}

// buf: [T, rank] fp32 contiguous (fully written); x: [T, in] rows ldx apart; a: [L, rank, in];
// slots: [T] int64; scales: [L] fp32.
void shrink(uintptr_t buf, uintptr_t x, int64_t ldx, uintptr_t a, uintptr_t slots,
            uintptr_t scales, int64_t num_tokens, int64_t in_features, int64_t rank,
            int64_t num_slots, int dtype, int num_threads) {
  check_dims(num_tokens, in_features, rank, num_slots);
  const Plan plan = plan_blocks(reinterpret_cast<const int64_t*>(slots), num_tokens, num_slots);
  float* out = reinterpret_cast<float*>(buf);
  py::gil_scoped_release release;
  std::memset(out, 0, sizeof(float) * num_tokens * rank);
  if (dtype == 0) {
    run_shrink<float>({reinterpret_cast<const float*>(x), ldx, reinterpret_cast<const float*>(a),
                       reinterpret_cast<const float*>(scales), out, in_features, rank},
                      plan, num_threads);
  } else if (dtype == 1) {
    run_shrink<Bf16>({reinterpret_cast<const Bf16*>(x), ldx, reinterpret_cast<const Bf16*>(a),
                      reinterpret_cast<const float*>(scales), out, in_features, rank},
                     plan, num_threads);
  } else {
    throw std::invalid_argument("dtype must be float32 or bfloat16");
  }
}

// y: [T, out] rows ldy apart (updated in place); buf: [T, rank] fp32 contiguous; bt:
// [L, rank, out]; slots: [T] int64.
void expand(uintptr_t y, int64_t ldy, uintptr_t buf, uintptr_t bt, uintptr_t slots,
            int64_t num_tokens, int64_t out_features, int64_t rank, int64_t num_slots, int dtype,
            int num_threads) {
  check_dims(num_tokens, out_features, rank, num_slots);
  const Plan plan = plan_blocks(reinterpret_cast<const int64_t*>(slots), num_tokens, num_slots);
  const float* b = reinterpret_cast<const float*>(buf);
  py::gil_scoped_release release;
  if (dtype == 0) {
    run_expand<float>({reinterpret_cast<float*>(y), ldy, b, reinterpret_cast<const float*>(bt),
                       out_features, rank},
                      plan, num_threads);
  } else if (dtype == 1) {
    run_expand<Bf16>({reinterpret_cast<Bf16*>(y), ldy, b, reinterpret_cast<const Bf16*>(bt),
                      out_features, rank},
                     plan, num_threads);
  } else {
    throw std::invalid_argument("dtype must be float32 or bfloat16");
  }
}

}  // namespace

void register_cpu_lora(py::module_& m) {
  m.doc() = "Batched LoRA shrink / expand with a per-token adapter slot.";
  m.def("avx512", &cpu_has_avx512, "Whether this CPU has AVX-512F/BW/VL.");
  m.def("set_use_avx512", &set_use_avx512, py::arg("on"),
        "Run the AVX-512 build (the default where the CPU has it) or the generic one.");
  trillm_cpu::def_kernel(m, "shrink", &shrink, py::arg("buf"), py::arg("x"), py::arg("ldx"), py::arg("a"),
        py::arg("slots"), py::arg("scales"), py::arg("num_tokens"), py::arg("in_features"),
        py::arg("rank"), py::arg("num_slots"), py::arg("dtype"), py::arg("num_threads"));
  trillm_cpu::def_kernel(m, "expand", &expand, py::arg("y"), py::arg("ldy"), py::arg("buf"), py::arg("bt"),
        py::arg("slots"), py::arg("num_tokens"), py::arg("out_features"), py::arg("rank"),
        py::arg("num_slots"), py::arg("dtype"), py::arg("num_threads"));
}
