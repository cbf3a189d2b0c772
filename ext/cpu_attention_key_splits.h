// Batch-1 decode attention split by key range over the threads (flash-decoding), included by
// ext/cpu_attention.cpp after its Problem and Item: the plan of an item's parts (Plan calls
// plan_key_splits when it plans) and the merge of their partials after the run. The kernels'
// side (a part's keys, its partial written instead of the output): split_keys and the end of
// attend_decode in ext/cpu_attention_decode.h.
#pragma once

// Decode items split by key range on small batches (plan_key_splits), read by the plans
// made after it is set; on by default (tests and benchmarks turn it off to compare).
std::atomic<bool>& key_splits() {
  static std::atomic<bool> on{true};
  return on;
}
constexpr int kMinSplitKeys = 64;  // keys a part at least
std::atomic<int64_t> split_items_run{0};  // parts run in this process (tests: a split ran)

// Small decode batches (batch 1): fewer one-row items than twice the threads leave threads
// idle (SmolLM2's 3 kv heads on 2 threads: 2 items on one, 1 on the other), so each item is
// also planned as parts of its keys (flash-decoding), every part's partial online softmax
// merged in part order after the run (merge_key_splits). The parts depend on the thread count
// and the context length only: the same plan, the same bits, however the threads take them.
// fp32 q at head_dim 64 / 128 (the one-row kernel); bf16 q rounds its probabilities with the
// row's whole sum and keeps its items.
int64_t plan_key_splits(const Problem& p, const std::vector<Item>& items, int threads,
                        std::vector<Item>& parts) {
  const int n = static_cast<int>(items.size());
  if (threads <= 1 || n == 0 || n >= 2 * threads) return 0;
  if (p.head_dim != 64 && p.head_dim != 128) return 0;
  for (const Item& it : items)
    if (it.row_end - it.row_begin != 1) return 0;
  const int want = (2 * threads + n - 1) / n;
  const int group = p.num_heads / p.num_kv_heads;
  int64_t offset = 0;
  bool any = false;
  for (const Item& it : items) {
    const int query_len = p.query_start_loc[it.req + 1] - p.query_start_loc[it.req];
    const int keys = p.seq_lens[it.req] - query_len + it.row_begin + 1;
    const int splits = std::max(1, std::min(want, keys / kMinSplitKeys));
    const int nvec = (it.head_end - it.head_begin) * group;
    for (int s = 0; s < splits; ++s) {
      Item part = it;
      part.split = s;
      part.splits = splits;
      part.partial = offset;
      if (splits > 1) offset += static_cast<int64_t>(nvec) * (p.head_dim + 2);
      parts.push_back(part);
    }
    any = any || splits > 1;
  }
  if (!any) parts.clear();
  return offset;
}

// fp32 out = the merged parts of each split item (in part order): m = max m_s, l = sum
// exp(m_s - m) l_s, acc likewise; then the sink, if any, and acc / l.
void merge_key_splits(const Problem& p, const std::vector<Item>& parts) {
  const int group = p.num_heads / p.num_kv_heads;
  const int D = p.head_dim;
  float acc[kMaxHeadDim];
  for (size_t i = 0; i < parts.size(); i += parts[i].splits) {
    const Item& it = parts[i];
    if (it.splits == 1) continue;
    const int nvec = (it.head_end - it.head_begin) * group;
    const int64_t token = p.query_start_loc[it.req] + it.row_begin;
    for (int v = 0; v < nvec; ++v) {
      const int64_t at = static_cast<int64_t>(v) * (D + 2);
      float m = -std::numeric_limits<float>::infinity();
      for (int s = 0; s < it.splits; ++s)
        m = std::max(m, p.partials[parts[i + s].partial + at]);
      float l = 0.0f;
      std::fill(acc, acc + D, 0.0f);
      for (int s = 0; s < it.splits; ++s) {
        const float* part = p.partials + parts[i + s].partial + at;
        const float c = std::exp(part[0] - m);  // 0 for an empty part (m_s -inf)
        l += c * part[1];
        for (int d = 0; d < D; ++d) acc[d] += c * part[2 + d];
      }
      const int head = it.head_begin * group + v;
      if (p.sinks != nullptr) {
        const float top = std::max(m, p.sinks[head]);
        const float c = std::exp(m - top);
        l = l * c + std::exp(p.sinks[head] - top);
        for (int d = 0; d < D; ++d) acc[d] *= c;
      }
      float* dst = static_cast<float*>(p.out) + token * p.out_token_stride +
                   static_cast<int64_t>(head) * p.out_head_stride;
      const float inv = 1.0f / l;
      for (int d = 0; d < D; ++d) dst[d] = acc[d] * inv;
    }
  }
}
