// bf16 attention as transformers' eager attention computes it, the pieces shared by the paged
// kernels (ext/cpu_attention.cpp, ext/cpu_attention_decode.h) and the fresh-prompt kernel
// (ext/cpu_prefill_attention.cpp): scores q . k rounded to bf16 (a bf16 matmul with fp32 sums),
// times the scale, rounded again (round_scores); then `softmax(scores, dtype=float32).to(bf16)`
// (rounded_softmax_row) and `P @ V` as a bf16 matmul (fp32 sums, one rounding at the store: the
// kernels' own P . V loops). An online softmax cannot round p: the normaliser is known only after
// the last key, hence two passes over every score of a work item (score_rows).
// Anonymous namespace: a copy per source file (all of it inlined or thread-local).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace {

// The two roundings of fp32 sums q . k: the bf16 matmul's store, then the scaled score's.
TRILLM_INLINE v8f round_scores(v8f sums, v8f scale) { return round_bf16(round_bf16(sums) * scale); }

// The eight values row[0 .. 8) of which only the first n < 8 exist; the rest `fill`.
TRILLM_INLINE v8f load_part(const float* row, int n, float fill) {
  alignas(32) float t[8];
  for (int u = 0; u < 8; ++u) t[u] = u < n ? row[u] : fill;
  return load8(t);
}

// Per-thread rows of every score of a work item: [rows][stride], grown, never shrunk.
TRILLM_INLINE float* score_rows(int rows, int stride) {
  static thread_local std::vector<float> all;
  const size_t need = static_cast<size_t>(rows) * stride;
  if (all.size() < need) all.resize(need);
  return all.data();
}

// row[0 .. n), n >= 1 scores -> their probabilities rounded to bf16, in place: p = exp(s - max)
// * (1 / sum exp) (torch's softmax multiplies by the reciprocal). row[n ..] is neither read nor
// written.
TRILLM_INLINE void rounded_softmax_row(float* row, int n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int full = n & ~7;
  v8f mx = splat(neg_inf);
  for (int i = 0; i < full; i += 8) {
    const v8f x = load8(row + i);
    mx = mx > x ? mx : x;
  }
  if (full < n) {
    const v8f x = load_part(row + full, n - full, neg_inf);
    mx = mx > x ? mx : x;
  }
  const v8f shift = splat(hmax(mx));
  v8f sum = splat(0.0f);
  v8f tail = splat(0.0f);  // the exps of the partial vector, if any
  for (int i = 0; i < n; i += 8) {  // the tail's -inf lanes: exactly 0
    const v8f e =
        exp_nonpositive((i < full ? load8(row + i) : load_part(row + i, n - i, neg_inf)) - shift);
    if (i < full) std::memcpy(row + i, &e, sizeof(e));
    else tail = e;
    sum += e;
  }
  const v8f inv = splat(1.0f / hsum(sum));
  for (int i = 0; i < n; i += 8) {
    const v8f w = round_bf16((i < full ? load8(row + i) : tail) * inv);
    if (i < full) std::memcpy(row + i, &w, sizeof(w));
    else std::memcpy(row + i, &w, (n - i) * sizeof(float));
  }
}

// Scores row[0 .. n) (fp32 sums q . k) -> their probabilities rounded to bf16, in place: the
// scores' two roundings (round_scores), then rounded_softmax_row.
TRILLM_INLINE void probabilities_of_scores(float* row, int n, v8f scale) {
  for (int c = 0; c < n; c += 8) {
    const v8f r =
        round_scores(c + 8 <= n ? load8(row + c) : load_part(row + c, n - c, 0.0f), scale);
    std::memcpy(row + c, &r, std::min(8, n - c) * sizeof(float));
  }
  rounded_softmax_row(row, n);
}

}  // namespace
