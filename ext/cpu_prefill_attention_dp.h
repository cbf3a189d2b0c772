// The fresh-prompt kernel's bf16 path on CPUs with AVX512-BF16 (included by
// ext/cpu_prefill_attention.cpp after its AVX2 code): the same item, the same rounding points
// (ext/cpu_attention_bf16.h), but both products run on vdpbf16ps (ext/cpu_attention_dp_tiles.h,
// shared with the paged kernel's long chunks), 32 bf16 products a zmm summed into 16 fp32 lanes
// in pairs, twice the multiply rate of the AVX2 path's fp32 FMAs and no bf16 -> fp32 widening
// of q, k or v. The sums are fp32 as in the AVX2 path, in another order (pairs), like any
// GEMM's; vdpbf16ps treats bf16 subnormal inputs as zero.
#pragma once

#include "cpu_attention_dp_tiles.h"

namespace {

// attend_item_bf16 (ext/cpu_prefill_attention.cpp) with both products on vdpbf16ps.
TRILLM_DOT_TARGET void attend_item_bf16_dp(const Problem& p, const Item& it) {
  FreshBf16Item item(p, it);
  dot_attend_item(item, p.scale);
}

}  // namespace
