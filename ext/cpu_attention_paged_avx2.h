// The paged kernel's prompt chunks with context on CPUs with AVX2 + FMA but no AVX512-BF16 (bf16
// q, bf16 cache): the fresh-prompt kernel's AVX2 tiles (ext/cpu_attention_avx2_tiles.h) with the
// keys and values read from the block-paged cache. Included by ext/cpu_attention.cpp inside its
// anonymous namespace, after Problem, Item and ext/cpu_attention_paged_dp.h (the same work items
// and layouts: kPdp*, paged_dp_layout; the setup around the passes, PagedChunk).
//
// Why: the tile kernel (ext/cpu_attention_tile.h) scores one query vector against eight keys
// at a time and reduces each score across lanes; here a 64-key tile is packed once (K^T in
// 16-key panels, bf16 widened to fp32) and each loaded key or value vector feeds six query
// vectors' FMAs (6 x 16 register blocks), as in a GEMM. Same rounding points as the tile
// kernel's bf16 path (ext/cpu_attention_bf16.h), the fp32 sums in another order.
#pragma once

// One item (it.head_begin: its kv head; rows it.row_begin .. it.row_end of request it.req).
__attribute__((target("avx2,fma"))) void attend_item_paged_avx2(const Problem& p, const Item& it) {
  PagedChunk c(p, it);
  bf16_attend_item(c, p.scale);
}
