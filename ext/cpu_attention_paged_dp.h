// The paged kernel's prompt chunks with context on CPUs with AVX512-BF16 (bf16 q, bf16 cache):
// the arithmetic of the fresh-prompt kernel's vdpbf16ps path (ext/cpu_prefill_attention_dp.h)
// with the keys and values read from the block-paged cache. Included by ext/cpu_attention.cpp
// inside its anonymous namespace, after Problem, Item and the bf16 rounding points.
//
// Why: a prompt longer than --max-num-batched-tokens is prefilled in chunks, and every chunk
// after the first attends to the cache. The tile kernel (ext/cpu_attention_tile.h) computes
// each score as a dot product of fp32 vectors, 16 query rows at a time: at Llama-3.2-1B's shape
// an 8,192-token prompt's second 4,096-token chunk ran at 32 GFLOP/s where the fresh kernel's
// first chunk ran at 100-126 (benchmarks/kernels/chunked_prefill_attention.py).
//
// Work item = (request, kv head, block of up to 96 / group query rows): every query head of the
// group at those rows (M <= 96 vectors). Its keys 0 .. context + last row, 64 at a time, are
// gathered from their blocks and run through the fresh kernel's tiles
// (ext/cpu_attention_dp_tiles.h: S = Q . K^T, the rounded softmax with every score of the item
// kept, O = P . V). Same rounding points as the tile kernel's bf16 path; the fp32 sums in
// another order (pairs). Only for windowless, uncapped layers with head_dim a multiple of 16 up
// to 256; the rest keeps the tile kernel (ext/cpu_attention_paged_avx2.h: the same items on
// CPUs with AVX2 only).
#pragma once

#include "cpu_attention_dp_tiles.h"

constexpr int kPdpMaxVectors = 96;    // query vectors per item
constexpr int kPdpMaxHeadDim = 256;
constexpr int kPdpMinQueryRows = 16;  // shorter chunks (speculative verification): the tile kernel

inline bool paged_dp_layout(int num_heads, int num_kv_heads, int head_dim) {
  return head_dim % 16 == 0 && head_dim <= kPdpMaxHeadDim &&
         num_heads / num_kv_heads <= kPdpMaxVectors;
}

// What both paged long-chunk kernels (this one and ext/cpu_attention_paged_avx2.h) share around
// their passes: the item's vectors (vector i: row row_begin + i / group of query head
// kv_head * group + i % group, at key position pos[i]), where their q and outputs are, and the
// gather of a tile's rows of keys or values (this kv head's, from their blocks).
struct PagedChunk {
  const Problem& p;
  const Item& it;
  int D, group, M, q0, context;
  const int32_t* blocks;  // the request's row of the block table
  int64_t head_off, slot_elems;
  int pos[kPdpMaxVectors];
  const Bf16* rows[64];

  PagedChunk(const Problem& p_, const Item& it_) : p(p_), it(it_) {
    D = p.head_dim;
    group = p.num_heads / p.num_kv_heads;
    M = (it.row_end - it.row_begin) * group;
    q0 = p.query_start_loc[it.req];
    context = p.seq_lens[it.req] - (p.query_start_loc[it.req + 1] - q0);
    blocks = p.block_table + static_cast<int64_t>(it.req) * p.block_table_stride;
    head_off = static_cast<int64_t>(it.head_begin) * D;
    slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
    for (int i = 0; i < M; ++i) pos[i] = context + it.row_begin + i / group;
  }
  int64_t token(int i) const { return q0 + it.row_begin + i / group; }
  int head(int i) const { return it.head_begin * group + i % group; }
  const Bf16* q_row(int i) const {
    return static_cast<const Bf16*>(p.q) + token(i) * p.q_token_stride + head(i) * p.q_head_stride;
  }
  // Keys (values false) or values key0 .. key0 + n -> their n row pointers (until the next call).
  const Bf16* const* operator()(bool values, int key0, int n) {
    const Bf16* base = static_cast<const Bf16*>(values ? p.v_cache : p.k_cache) + head_off;
    int b = key0 / p.block_size, o = key0 % p.block_size;
    for (int t = 0; t < n; ++t) {
      rows[t] = base + (static_cast<int64_t>(blocks[b]) * p.block_size + o) * slot_elems;
      if (++o == p.block_size) o = 0, ++b;
    }
    return rows;
  }
  // acc [M][D] -> the output rows, rounded once.
  void store_rows(const float* acc) const {
    for (int i = 0; i < M; ++i) {
      Bf16* dst = static_cast<Bf16*>(p.out) + token(i) * p.out_token_stride +
                  head(i) * p.out_head_stride;
      for (int d = 0; d < D; ++d) store(dst + d, acc[i * D + d]);
    }
  }
};

// One item (it.head_begin: its kv head; rows it.row_begin .. it.row_end of request it.req).
TRILLM_DOT_TARGET void attend_item_paged_dp(const Problem& p, const Item& it) {
  PagedChunk c(p, it);
  dot_attend_item(c, p.scale);
}
