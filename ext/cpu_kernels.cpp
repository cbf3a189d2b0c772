// trillm._ext.cpu_kernels: the native CPU kernels in one module, so they share one thread pool.
//   .attention  paged attention over the block-paged KV cache (cpu_attention.cpp) and causal
//               attention of fresh prompts (cpu_prefill_attention.cpp)
//   .gemm       fp32 GEMM with packed weights for the linear layers (cpu_gemm.cpp)
//   .gemm_bf16  bf16 GEMM (AVX512-BF16, fp32 sums) with packed weights (cpu_gemm_bf16.cpp)
//   .gemm_fp16  fp16 GEMM (F16C widening, fp32 sums) with packed weights (cpu_gemm_fp16.cpp)
//   .gemm_fp8   fp8 e4m3 weight-only GEMM (bytes widened to bf16, vdpbf16ps) (cpu_gemm_fp8.cpp)
//   .gemm_q     GEMM with Q4_0/Q4_1/Q8_0 weights kept quantized (cpu_gemm_q.cpp)
//   .ops        fused elementwise ops: RMSNorm, rotary, silu * mul (cpu_ops.cpp)
//   .lora       batched LoRA shrink / expand, per-token adapter slot (cpu_lora.cpp)
//   .program    bound kernel calls run in order: native step programs (cpu_program.cpp)
#include <pybind11/pybind11.h>

#include "cpu_common.h"

namespace py = pybind11;

void register_cpu_attention(py::module_& m);
void register_cpu_prefill_attention(py::module_& m);
void register_cpu_gemm(py::module_& m);
void register_cpu_gemm_bf16(py::module_& m);
void register_cpu_gemm_fp16(py::module_& m);
void register_cpu_gemm_fp8(py::module_& m);
void register_cpu_gemm_q(py::module_& m);
void register_cpu_ops(py::module_& m);
void register_cpu_lora(py::module_& m);
void register_cpu_program(py::module_& m);

namespace trillm_cpu {

// Never destroyed: their threads block until the process exits. One pool per worker count, kept
// for the process: a thread count that alternates (two engines in one process with different
// --threads, a test that sets torch's thread count back and forth) reuses its pool instead of
// starting threads each change (a new pool per change left the old one's threads parked: 20
// alternations of 2 and 3 threads grew the process by 30 threads). A forked child inherits the
// objects but not their threads, so the pools are remade when the pid changes (the old ones leak).
std::vector<ThreadPool*> g_pools;
std::mutex g_pool_mu;

ThreadPool* pool_for(int num_threads) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  const int workers = num_threads - 1;
  if (!g_pools.empty() && g_pools.front()->pid() != getpid()) g_pools.clear();
  for (ThreadPool* pool : g_pools)
    if (pool->num_workers() == workers) return pool;
  g_pools.push_back(new ThreadPool(workers));
  return g_pools.back();
}

void park_pools() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  for (ThreadPool* pool : g_pools)
    if (pool->pid() == getpid()) pool->park();
}


}  // namespace trillm_cpu

PYBIND11_MODULE(cpu_kernels, m) {
  m.doc() = "Native CPU kernels: paged attention, packed-weight GEMM, fused elementwise ops.";
  // First: the kernels' bind_* functions return its Thunk.
  py::module_ program = m.def_submodule("program");
  register_cpu_program(program);
  py::module_ attention = m.def_submodule("attention");
  register_cpu_attention(attention);
  register_cpu_prefill_attention(attention);
  py::module_ gemm = m.def_submodule("gemm");
  register_cpu_gemm(gemm);
  py::module_ gemm_bf16 = m.def_submodule("gemm_bf16");
  register_cpu_gemm_bf16(gemm_bf16);
  py::module_ gemm_fp16 = m.def_submodule("gemm_fp16");
  register_cpu_gemm_fp16(gemm_fp16);
  py::module_ gemm_fp8 = m.def_submodule("gemm_fp8");
  register_cpu_gemm_fp8(gemm_fp8);
  py::module_ gemm_q = m.def_submodule("gemm_q");
  register_cpu_gemm_q(gemm_q);
  py::module_ ops = m.def_submodule("ops");
  register_cpu_ops(ops);
  py::module_ lora = m.def_submodule("lora");
  register_cpu_lora(lora);
}
