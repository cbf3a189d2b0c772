// Which kernels run the paged attention's long bf16 chunks and its bf16 decode rows: the best
// the CPU has by default, another one (that it has) by name for tests and benchmarks
// (paged_chunk_kernel, paged_decode_kernel). Included by ext/cpu_attention.cpp inside its
// anonymous namespace, after TRILLM_PAGED_DP is defined.
#pragma once

inline bool cpu_has_paged_dp() {
#if TRILLM_PAGED_DP
  return cpu_has_avx512bf16();
#else
  return false;
#endif
}

// Which kernel runs the long bf16 chunks with context (Plan::plan_chunk_items): vdpbf16ps where
// the CPU has AVX512-BF16, else the AVX2 tiles where it has AVX2 + FMA, else the tile kernel.
// paged_chunk_kernel(name) picks another one the CPU has (tests, benchmarks); "bf16-dot-per-item"
// is vdpbf16ps with each item packing its own key / value tiles, as before PdpShared
// (ext/cpu_attention_paged_dp.h) packed them once per call (benchmarks, tests: the same bits).
enum ChunkKernel : int { kChunkTile = 0, kChunkAvx2 = 1, kChunkBf16Dot = 2, kChunkBf16DotItem = 3 };
const char* const kChunkKernelNames[] = {"tile", "avx2", "bf16-dot", "bf16-dot-per-item"};

bool cpu_has_chunk_kernel(int k) {
#if TRILLM_PAGED_DP
  if (k == kChunkBf16Dot || k == kChunkBf16DotItem) return cpu_has_paged_dp();
  if (k == kChunkAvx2) return cpu_has_avx2();
#endif
  return k == kChunkTile;
}
std::atomic<int>& chunk_kernel() {
  static std::atomic<int> k{cpu_has_chunk_kernel(kChunkBf16Dot) ? kChunkBf16Dot
                            : cpu_has_chunk_kernel(kChunkAvx2)  ? kChunkAvx2
                                                                : kChunkTile};
  return k;
}
// Items attend_item_paged_avx2 ([kChunkAvx2]) and _dp ([kChunkBf16Dot], either packing) have
// run in this process (tests: which one ran).
std::atomic<int64_t> chunk_items_run[3];

// The most bytes of key / value tiles "bf16-dot" packs at once (PdpShared), read by the plans
// made after it is set (tests: several batches, a unit packed per item).
std::atomic<int64_t>& chunk_pack_bytes() {
  static std::atomic<int64_t> n{int64_t{64} << 20};
  return n;
}

// The setting `setting` (one of names[0 .. N)) set to `name` where the CPU has it (has(k));
// name "" leaves it; -> the kernel before. `what`: "chunk" or "decode", for the errors.
template <size_t N>
std::string pick_kernel(const std::string& name, const char* const (&names)[N],
                        std::atomic<int>& setting, bool (*has)(int), const char* what) {
  const std::string before = names[setting.load()];
  if (name.empty()) return before;
  std::string known;
  for (size_t k = 0; k < N; ++k) {
    known += std::string(k ? ", '" : "'") + names[k] + "'";
    if (name != names[k]) continue;
    if (!has(static_cast<int>(k)))
      throw std::runtime_error("this CPU (or build) has no '" + name + "' " + what + " kernel");
    setting.store(static_cast<int>(k));
    return before;
  }
  throw std::invalid_argument(std::string("the ") + what + " kernel must be one of " + known);
}

std::string paged_chunk_kernel(const std::string& name) {
  return pick_kernel(name, kChunkKernelNames, chunk_kernel(), &cpu_has_chunk_kernel, "chunk");
}

// Which kernel runs the one-row items (decode rows), head_dim 64 or 128: for bf16 q over a bf16
// cache vdpbf16ps (attend_decode_dp) where the CPU has AVX512-BF16; the other bf16 / fp8 caches
// there, and both on CPUs with AVX2 + FMA only, the one-row kernel with each key / value row
// widened once for a block of its GQA group (attend_decode<..., true>, "avx2"); fp32 caches (and
// everything under "one-row") the one-row kernel widening the rows per query vector.
// paged_decode_kernel(name) picks another one the CPU has (tests, benchmarks); "bf16-dot" is
// attend_decode_ds (each cache slot read once for the item's kv heads), "bf16-dot-per-head"
// attend_decode_dp (the keys walked once per kv head, as before it: the same bits).
enum DecodeKernel : int {
  kDecodeRow = 0,
  kDecodeBf16Dot = 1,
  kDecodeAvx2 = 2,
  kDecodeBf16DotPerHead = 3
};
const char* const kDecodeKernelNames[] = {"one-row", "bf16-dot", "avx2", "bf16-dot-per-head"};

bool cpu_has_decode_kernel(int k) {
#if TRILLM_PAGED_DP
  if (k == kDecodeBf16Dot || k == kDecodeBf16DotPerHead) return cpu_has_paged_dp();
  if (k == kDecodeAvx2) return cpu_has_avx2();
#endif
  return k == kDecodeRow;
}
std::atomic<int>& decode_kernel() {
  static std::atomic<int> k{cpu_has_decode_kernel(kDecodeBf16Dot) ? kDecodeBf16Dot
                            : cpu_has_decode_kernel(kDecodeAvx2)  ? kDecodeAvx2
                                                                  : kDecodeRow};
  return k;
}

std::string paged_decode_kernel(const std::string& name) {
  return pick_kernel(name, kDecodeKernelNames, decode_kernel(), &cpu_has_decode_kernel, "decode");
}
