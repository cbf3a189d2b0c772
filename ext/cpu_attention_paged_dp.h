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
  Bf16* out_row(int i) const {
    return static_cast<Bf16*>(p.out) + token(i) * p.out_token_stride + head(i) * p.out_head_stride;
  }
  // acc [M][D] -> the output rows, rounded once.
  void store_rows(const float* acc) const {
    for (int i = 0; i < M; ++i) {
      Bf16* dst = out_row(i);
      for (int d = 0; d < D; ++d) store(dst + d, acc[i * D + d]);
    }
  }
};

// One item (it.head_begin: its kv head; rows it.row_begin .. it.row_end of request it.req).
// shared: its kv head's tiles packed already (PdpShared), or nullptr: packed here.
TRILLM_DOT_TARGET void attend_item_paged_dp(const Problem& p, const Item& it,
                                            const uint16_t* shared = nullptr) {
  PagedChunk c(p, it);
  dot_attend_item(c, p.scale, shared);
}

// The long chunks' keys and values packed once per call (Plan::run), not once per item: every
// item of a kv head packed all of its keys' tiles itself, ~25% of the path's time at
// Llama-3.2-1B's shape (an 8,192-token prompt's chunks: 86 items of 24 rows a kv head). Unit =
// (request, kv head): its seq_len keys as kDotTileElems tiles, packed by pack tasks of
// kPdpPackTiles tiles on the threads, then the unit's items read them. The scratch is bounded
// (chunk_pack_bytes, default 64 MiB): the units run in batches that fit it, each batch packed
// then attended; a unit larger than it alone packs per item as before. Same tiles, same
// products, so the same bits as packing per item.
constexpr int kPdpPackTiles = 16;  // tiles per pack task

class PdpShared {
 public:
  // long_items (all of kv head h of one request for each (request, h) present) -> reordered:
  // batch by batch, the most work first within each.
  void plan(const Problem& p, std::vector<Item>& long_items, int64_t cap_bytes) {
    units_.clear(), batches_.clear(), tasks_.clear(), item_unit_.clear(), max_elems_ = 0;
    std::vector<int> unit_of(long_items.size());
    int req_first = 0;  // the unit of kv head 0 of the current request (all its heads present)
    for (size_t i = 0; i < long_items.size(); ++i) {  // a request's items are contiguous
      const Item& it = long_items[i];
      if (i == 0 || it.req != long_items[i - 1].req) {
        req_first = static_cast<int>(units_.size());
        const int tiles = (p.seq_lens[it.req] + kDotKeys - 1) / kDotKeys;
        for (int h = 0; h < p.num_kv_heads; ++h) units_.push_back({it.req, h, tiles, 0, 0});
      }
      unit_of[i] = req_first + it.head_begin;
    }
    const int64_t cap = cap_bytes / static_cast<int64_t>(sizeof(uint16_t));
    int64_t used = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      const int64_t elems = units_[u].tiles * kDotTileElems(p.head_dim);
      if (batches_.empty() || (elems <= cap && used + elems > cap)) {
        const int t0 = static_cast<int>(tasks_.size());
        batches_.push_back({0, 0, t0, t0});
        used = 0;
      }
      units_[u].batch = static_cast<int>(batches_.size()) - 1;
      units_[u].off = elems <= cap ? used : -1;  // -1: packed per item
      if (elems > cap) continue;
      used += elems;
      max_elems_ = std::max(max_elems_, used);
      for (int t = 0; t < units_[u].tiles; t += kPdpPackTiles)
        tasks_.push_back({static_cast<int>(u), t, std::min(units_[u].tiles, t + kPdpPackTiles)});
      batches_.back().task_end = static_cast<int>(tasks_.size());
    }
    auto work = [&](const Item& it) {  // keys x rows
      const int query_len = p.query_start_loc[it.req + 1] - p.query_start_loc[it.req];
      const int64_t keys = p.seq_lens[it.req] - query_len + it.row_end;
      return keys * (it.row_end - it.row_begin);
    };
    std::vector<int> order(long_items.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const int ba = units_[unit_of[a]].batch, bb = units_[unit_of[b]].batch;
      if (ba != bb) return ba < bb;
      return work(long_items[a]) > work(long_items[b]);
    });
    std::vector<Item> sorted;
    for (int i : order) sorted.push_back(long_items[i]), item_unit_.push_back(unit_of[i]);
    long_items = std::move(sorted);
    for (size_t i = 0; i < item_unit_.size(); ++i)
      batches_[units_[item_unit_[i]].batch].item_end = static_cast<int>(i) + 1;
    for (size_t b = 1; b < batches_.size(); ++b) batches_[b].item_begin = batches_[b - 1].item_end;
  }

  // items: the long items as plan() left them, then n_rest others (rest(i) runs item i);
  // the others run with the last batch.
  template <typename Rest>
  void run(const Problem& p, int num_threads, const std::vector<Item>& items, Rest&& rest) const {
    std::unique_ptr<uint16_t[]> scratch(max_elems_ > 0 ? new uint16_t[max_elems_] : nullptr);
    uint16_t* base = scratch.get();
    const int D = p.head_dim;
    for (size_t b = 0; b < batches_.size(); ++b) {
      const Batch& batch = batches_[b];
      run_items(num_threads, batch.task_end - batch.task_begin, [&](int i) {
        const Task& t = tasks_[batch.task_begin + i];
        const Unit& u = units_[t.unit];
        const Item one{u.req, 0, 1, u.head, u.head + 1};
        PagedChunk c(p, one);
        const int keys = p.seq_lens[u.req];
        for (int tile = t.first; tile < t.last; ++tile) {
          const int key0 = tile * kDotKeys;
          pack_dot_tile(c, key0, std::min(kDotKeys, keys - key0), D,
                        base + u.off + tile * kDotTileElems(D));
        }
      });
      const bool last = b + 1 == batches_.size();
      const int n = (last ? static_cast<int>(items.size()) : batch.item_end) - batch.item_begin;
      run_items(num_threads, n, [&](int i) {
        const int k = batch.item_begin + i;
        if (k >= batch.item_end) return rest(k);
        const Unit& u = units_[item_unit_[k]];
        attend_item_paged_dp(p, items[k], u.off >= 0 ? base + u.off : nullptr);
      });
    }
  }

 private:
  struct Unit {
    int req, head, tiles, batch;
    int64_t off;  // in the scratch, uint16 elements; -1: none (packed per item)
  };
  struct Batch {
    int item_begin, item_end, task_begin, task_end;
  };
  struct Task {
    int unit, first, last;  // tiles first .. last - 1
  };
  std::vector<Unit> units_;
  std::vector<Batch> batches_;
  std::vector<Task> tasks_;
  std::vector<int> item_unit_;  // per long item
  int64_t max_elems_ = 0;
};
