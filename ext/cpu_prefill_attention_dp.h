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

// attend_item_bf16 (ext/cpu_prefill_attention.cpp) with both products on vdpbf16ps. shared:
// the item's kv head's tiles of its segment packed already, or nullptr (packed here).
TRILLM_DOT_TARGET void attend_item_bf16_dp(const Problem& p, const Item& it,
                                           const uint16_t* shared = nullptr) {
  FreshBf16Item item(p, it);
  dot_attend_item(item, p.scale, shared);
}

// The items of one call with each (segment, kv head)'s key / value tiles packed once
// (pack_dot_tile, kFreshPackTiles tiles a task on the threads) before they run, not once per
// item (a 1,024-row prompt's 43 items a kv head each packed its keys so far); the same bits.
// Packed tiles above kFreshPackBytes: every item packs its own, as before.
constexpr int kFreshPackTiles = 16;
constexpr int64_t kFreshPackBytes = int64_t{64} << 20;

inline void run_bf16_dp_shared(const Problem& p, const std::vector<Item>& items,
                               const int32_t* seg, int num_segments, int num_threads) {
  const int D = p.head_dim, H = p.num_kv_heads;
  std::vector<int64_t> off(static_cast<size_t>(num_segments) * H + 1, 0);  // unit s * H + h
  for (int s = 0; s < num_segments; ++s)
    for (int h = 0; h < H; ++h) {
      const int64_t u = static_cast<int64_t>(s) * H + h;
      off[u + 1] = off[u] + (seg[2 * s + 1] + kDotKeys - 1) / kDotKeys * kDotTileElems(D);
    }
  const int64_t total = off.back();
  const bool share = total > 0 && total * 2 <= kFreshPackBytes;
  std::unique_ptr<uint16_t[]> scratch(share ? new uint16_t[total] : nullptr);
  uint16_t* base = scratch.get();
  if (share) {
    std::vector<Item> tasks;  // (segment start, kv head, tiles first .. last - 1, segment)
    for (int s = 0; s < num_segments; ++s) {
      const int tiles = (seg[2 * s + 1] + kDotKeys - 1) / kDotKeys;
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < tiles; t += kFreshPackTiles)
          tasks.push_back({seg[2 * s], h, t, std::min(tiles, t + kFreshPackTiles), s});
    }
    run_items(num_threads, static_cast<int>(tasks.size()), [&](int i) {
      const Item& t = tasks[i];
      const Item one{t.start, t.kv_head, 0, 1, t.seg};
      FreshBf16Item item(p, one);
      const int keys = seg[2 * t.seg + 1];
      uint16_t* unit = base + off[static_cast<int64_t>(t.seg) * H + t.kv_head];
      for (int tile = t.first; tile < t.last; ++tile)
        pack_dot_tile(item, tile * kDotKeys, std::min(kDotKeys, keys - tile * kDotKeys), D,
                      unit + tile * kDotTileElems(D));
    });
  }
  run_items(num_threads, static_cast<int>(items.size()), [&](int i) {
    const Item& it = items[i];
    attend_item_bf16_dp(
        p, it, share ? base + off[static_cast<int64_t>(it.seg) * H + it.kv_head] : nullptr);
  });
}

}  // namespace
