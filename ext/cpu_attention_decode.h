// The paged-attention kernel of one-row tiles (every decode step's items; head_dim 64 or 128,
// register-resident rows), one of the two kernels of ext/cpu_attention.cpp: included there,
// inside its anonymous namespace, after Problem, Item, start_vector / store_output and the bf16
// rounding points (finish_scores, rounded_softmax_pv).
#pragma once

// A one-row tile (every decode step's items). Keys are taken a chunk of kDecodeChunk at a time
// (eight groups of eight slots): (0) one load per 64-byte line of the chunk's K and V rows brings
// them into L2 in one burst of independent misses; (1) the chunk's scores q . k, eight slots at
// a time with one transposing add tree per eight, into a per-thread row per query vector;
// (2) per query vector one online-softmax update for the whole chunk (a max, a correction, a
// vectorised exp); (3) acc = acc * correction + sum_t w_t v_t.
// Why the burst: interleaved with the math, the misses of a one-row tile overlap badly on this
// VM (prefetch instructions 1-8 groups ahead did not help); loading first, measured
// alternately in one process (2 threads, batch 53 x 256 keys, 1 GB cache): contiguous blocks
// 20.8 against 18.0 GB/s for the per-8-slot online softmax this replaces, random blocks 16.9
// against 14.7 (a plain read of the same rows: 24-29).
constexpr int kDecodeGroup = 8;
constexpr int kDecodeChunk = 64;
thread_local volatile float touch_sink;  // keeps the touching loads

// Shared (attend_decode<..., true>, the "avx2" decode kernel): each key / value row is widened
// once for a block of up to kShareVectors query vectors of its kv head instead of once per vector
// (the cost of a bf16 or fp8 row's widening is then shared by the GQA group), with every lane's
// sums taken in the same order as the per-vector loops: the same bits.
constexpr int kShareVectors = 4;

// dst[r][0 .. 8) = the scores of R query vectors (qv rows of NV, in a row) against the 8 key
// rows k[0 .. 8), two keys at a time.
template <typename T, typename C, int NV, int R>
TRILLM_INLINE void shared_scores8(const Problem& p, const v8f* qv, const C* const* k,
                                  float* const* dst) {
  v8f a[R][kDecodeGroup];
  for (int i = 0; i < kDecodeGroup; i += 2) {
    v8f x0[R], x1[R];
    {
      const v8f k0 = load8(k[i]), k1 = load8(k[i + 1]);
      for (int r = 0; r < R; ++r) x0[r] = qv[r * NV] * k0, x1[r] = qv[r * NV] * k1;
    }
    for (int j = 1; j < NV; ++j) {
      const v8f k0 = load8(k[i] + 8 * j), k1 = load8(k[i + 1] + 8 * j);
      for (int r = 0; r < R; ++r) {
        x0[r] += qv[r * NV + j] * k0;
        x1[r] += qv[r * NV + j] * k1;
      }
    }
    for (int r = 0; r < R; ++r) a[r][i] = x0[r], a[r][i + 1] = x1[r];
  }
  for (int r = 0; r < R; ++r) {
    const v8f sums = finish_scores<T>(sum_lanes8(a[r]), p);
    std::memcpy(dst[r], &sums, sizeof(sums));
  }
}

// acc[r][0 .. NV) += sum_u w[r][u] * v_u for R query vectors over the n value rows rows[u], keys
// in order; two lanes of 8 at a time, each value row's pair widened once for the R vectors.
template <typename C, int NV, int R>
TRILLM_INLINE void shared_pv(const float* const* w, const C* const* rows, int n, v8f* acc) {
  for (int j = 0; j < NV; j += 2) {
    v8f o0[R], o1[R];
    for (int r = 0; r < R; ++r) o0[r] = acc[r * NV + j], o1[r] = acc[r * NV + j + 1];
    for (int u = 0; u < n; ++u) {
      const v8f x0 = load8(rows[u] + 8 * j), x1 = load8(rows[u] + 8 * j + 8);
      for (int r = 0; r < R; ++r) {
        const v8f wr = splat(w[r][u]);
        o0[r] += wr * x0;
        o1[r] += wr * x1;
      }
    }
    for (int r = 0; r < R; ++r) acc[r * NV + j] = o0[r], acc[r * NV + j + 1] = o1[r];
  }
}

// The two above over a kv head's group of query vectors (qv / acc rows from its first, dst / w
// one pointer a vector), in blocks of up to kShareVectors. (No lambdas: a lambda's body is not
// compiled for the target of the function it is written in.)
template <typename T, typename C, int NV>
TRILLM_INLINE void shared_scores_group(const Problem& p, int group, const v8f* qv,
                                       const C* const* k, float* const* dst) {
  for (int g = 0; g < group; g += kShareVectors) {
    const v8f* qg = qv + g * NV;
    switch (std::min(kShareVectors, group - g)) {
      case 4: shared_scores8<T, C, NV, 4>(p, qg, k, dst + g); break;
      case 3: shared_scores8<T, C, NV, 3>(p, qg, k, dst + g); break;
      case 2: shared_scores8<T, C, NV, 2>(p, qg, k, dst + g); break;
      default: shared_scores8<T, C, NV, 1>(p, qg, k, dst + g); break;
    }
  }
}
template <typename C, int NV>
TRILLM_INLINE void shared_pv_group(int group, const float* const* w, const C* const* rows, int n,
                                   v8f* acc) {
  for (int g = 0; g < group; g += kShareVectors) {
    v8f* ag = acc + g * NV;
    switch (std::min(kShareVectors, group - g)) {
      case 4: shared_pv<C, NV, 4>(w + g, rows, n, ag); break;
      case 3: shared_pv<C, NV, 3>(w + g, rows, n, ag); break;
      case 2: shared_pv<C, NV, 2>(w + g, rows, n, ag); break;
      default: shared_pv<C, NV, 1>(w + g, rows, n, ag); break;
    }
  }
}

// Part it.split of it.splits of the keys [key_begin, key_end) (plan_key_splits in
// ext/cpu_attention_key_splits.h, fp32 q only): the parts of equal length in whole groups of 8, the last one the rest; a part that a
// short window leaves empty has no keys (its partial: m -inf, l 0).
TRILLM_INLINE void split_keys(const Item& it, int& key_begin, int& key_end) {
  const int per = ((key_end - key_begin + it.splits - 1) / it.splits + kDecodeGroup - 1) /
                  kDecodeGroup * kDecodeGroup;
  const int begin = std::min(key_end, key_begin + it.split * per);
  key_end = std::min(key_end, begin + per);
  key_begin = begin;
}

template <typename T, typename C, int NV, bool Shared = false>
TRILLM_INLINE void attend_decode(const Problem& p, const Item& it) {
  constexpr int D = NV * 8;
  const int group = p.num_heads / p.num_kv_heads;
  const int heads = it.head_end - it.head_begin;
  const int nvec = heads * group;  // query vector v: query head it.head_begin * group + v
  const int q0 = p.query_start_loc[it.req];
  const int query_len = p.query_start_loc[it.req + 1] - q0;
  const int row = it.row_begin;
  int key_end = p.seq_lens[it.req] - query_len + row + 1;  // keys .. its own position
  int key_begin = p.window > 0 ? std::max(0, key_end - p.window) : 0;
  const bool part = !kBf16Scores<T> && it.splits > 1;
  if (part) split_keys(it, key_begin, key_end);
  const int32_t* blocks = p.block_table + static_cast<int64_t>(it.req) * p.block_table_stride;
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t first = static_cast<int64_t>(it.head_begin) * D;  // the item's heads in a row
  const int span_bytes = static_cast<int>(heads * D * sizeof(C));
  const C* kc = static_cast<const C*>(p.k_cache) + first;
  const C* vc = static_cast<const C*>(p.v_cache) + first;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int groups = (key_end - key_begin + kDecodeGroup - 1) / kDecodeGroup;
  // bf16 q: every score kept for the second pass ([nvec][stride], keys key_begin + i).
  const int stride = groups * kDecodeGroup;
  float* all = kBf16Scores<T> ? score_rows(nvec, stride) : nullptr;

  alignas(32) static thread_local v8f qv[kMaxLanes];   // [nvec][NV], times q_scale<T>
  alignas(32) static thread_local v8f acc[kMaxLanes];  // [nvec][NV]
  alignas(32) static thread_local float scores[kMaxVectors * kDecodeChunk];  // [nvec][chunk]
  float m[kMaxVectors], l[kMaxVectors];
  const T* q = static_cast<const T*>(p.q) + (q0 + row) * p.q_token_stride;
  for (int v = 0; v < nvec; ++v) {
    start_vector(p, q + (it.head_begin * group + v) * p.q_head_stride, NV, qv + v * NV,
                 acc + v * NV);
    m[v] = neg_inf;
    l[v] = 0.0f;
  }

  // Slot offsets (in elements) of keys key_begin + g * 8 .. + 7, past key_end repeating the
  // last key (their scores are masked, their weights 0).
  auto group_slots = [&](int g, int64_t* slot) {
    for (int i = 0; i < kDecodeGroup; ++i) {
      const int key = std::min(key_begin + g * kDecodeGroup + i, key_end - 1);
      slot[i] = (static_cast<int64_t>(blocks[key / p.block_size]) * p.block_size +
                 key % p.block_size) * slot_elems;
    }
  };
  constexpr int kGroups = kDecodeChunk / kDecodeGroup;
  int64_t slots[kGroups][kDecodeGroup];
  for (int g0 = 0; g0 < groups; g0 += kGroups) {
    const int ng = std::min(kGroups, groups - g0);
    const int width = ng * kDecodeGroup;
    // (0) Touch the chunk's rows: one load a line (the sum only keeps the loads).
    v8f sink = splat(0.0f);
    for (int c = 0; c < ng; ++c) {
      group_slots(g0 + c, slots[c]);
      if (Shared && g0 > 0) continue;  // prefetched during the chunk before
      for (int i = 0; i < kDecodeGroup; ++i) {
        const C* kr = kc + slots[c][i];
        const C* vr = vc + slots[c][i];
        for (int b = 0; b < span_bytes / static_cast<int>(sizeof(C)); b += 64 / sizeof(C))
          sink += load8(kr + b) + load8(vr + b);
      }
    }
    touch_sink = sink[0];
    // Shared: the next chunk's rows are prefetched (into L2) while this one is computed.
    for (int c = 0; Shared && c < std::min(kGroups, groups - g0 - kGroups); ++c) {
      int64_t next[kDecodeGroup];
      group_slots(g0 + kGroups + c, next);
      for (int i = 0; i < kDecodeGroup; ++i) {
        for (int b = 0; b < span_bytes / static_cast<int>(sizeof(C)); b += 64 / sizeof(C)) {
          __builtin_prefetch(kc + next[i] + b, 0, 2);  // to L2: L1 holds this chunk
          __builtin_prefetch(vc + next[i] + b, 0, 2);
        }
      }
    }
    // (1) Scores of the chunk.
    for (int c = 0; c < ng; ++c) {
      const int64_t* slot = slots[c];
      if (Shared) {
        for (int hh = 0; hh < heads; ++hh) {
          const C* k[kDecodeGroup];
          for (int i = 0; i < kDecodeGroup; ++i) k[i] = kc + slot[i] + hh * D;
          float* dst[kMaxVectors];
          for (int g = 0; g < group; ++g) {
            const int v = hh * group + g;
            dst[g] = kBf16Scores<T> ? all + static_cast<int64_t>(v) * stride + (g0 + c) * kDecodeGroup
                                    : scores + v * kDecodeChunk + c * kDecodeGroup;
          }
          shared_scores_group<T, C, NV>(p, group, qv + hh * group * NV, k, dst);
        }
        continue;
      }
      for (int v = 0; v < nvec; ++v) {
        const int64_t h = (v / group) * D;
        const v8f* qr = qv + v * NV;
        v8f a[kDecodeGroup];
        for (int i = 0; i < kDecodeGroup; ++i) {
          const C* k = kc + slot[i] + h;
          v8f x = qr[0] * load8(k);
          for (int j = 1; j < NV; ++j) x += qr[j] * load8(k + 8 * j);
          a[i] = x;
        }
        const v8f sums = finish_scores<T>(sum_lanes8(a), p);
        float* dst = kBf16Scores<T> ? all + static_cast<int64_t>(v) * stride +
                                          (g0 + c) * kDecodeGroup
                                    : scores + v * kDecodeChunk + c * kDecodeGroup;
        std::memcpy(dst, &sums, sizeof(sums));
      }
    }
    if (kBf16Scores<T>) continue;  // softmax and P @ V after the last chunk
    const int valid = std::min(width, key_end - key_begin - g0 * kDecodeGroup);
    for (int v = 0; v < nvec; ++v) {
      // (2) Online softmax over the chunk.
      float* s = scores + v * kDecodeChunk;
      if (p.softcap > 0.0f) soft_cap(s, valid, p.softcap);
      for (int t = valid; t < width; ++t) s[t] = neg_inf;
      v8f mx = splat(m[v]);
      for (int t = 0; t < width; t += kDecodeGroup) {
        const v8f x = load8(s + t);
        mx = mx > x ? mx : x;
      }
      const float chunk_max = hmax(mx);
      const v8f shift = splat(chunk_max);
      v8f sum = splat(0.0f);
      for (int t = 0; t < width; t += kDecodeGroup) {
        const v8f e = exp_nonpositive(load8(s + t) - shift);
        std::memcpy(s + t, &e, sizeof(e));
        sum += e;
      }
      const float correction = exp_nonpositive(splat(m[v] - chunk_max))[0];  // 0 at first
      l[v] = l[v] * correction + hsum(sum);
      m[v] = chunk_max;
      if (Shared) {  // (3) for the whole group below
        for (int j = 0; j < NV; ++j) acc[v * NV + j] = acc[v * NV + j] * splat(correction);
        continue;
      }
      // (3) acc = acc * correction + sum_t w_t v_t.
      const int64_t h = (v / group) * D;
      v8f r[NV];
      for (int j = 0; j < NV; ++j) r[j] = acc[v * NV + j] * splat(correction);
      for (int c = 0; c < ng; ++c) {
        const float* w = s + c * kDecodeGroup;
        for (int i = 0; i < kDecodeGroup; ++i) {
          const v8f wi = splat(w[i]);
          const C* val = vc + slots[c][i] + h;
          for (int j = 0; j < NV; ++j) r[j] += wi * load8(val + 8 * j);
        }
      }
      for (int j = 0; j < NV; ++j) acc[v * NV + j] = r[j];
    }
    if (Shared) {  // (3) acc (already times its correction) += sum_t w_t v_t, a group at a time
      for (int hh = 0; hh < heads; ++hh) {
        for (int c = 0; c < ng; ++c) {
          const C* vr[kDecodeGroup];
          for (int i = 0; i < kDecodeGroup; ++i) vr[i] = vc + slots[c][i] + hh * D;
          const float* w[kMaxVectors];
          for (int g = 0; g < group; ++g)
            w[g] = scores + (hh * group + g) * kDecodeChunk + c * kDecodeGroup;
          shared_pv_group<C, NV>(group, w, vr, kDecodeGroup, acc + hh * group * NV);
        }
      }
    }
  }
  if (kBf16Scores<T> && Shared) {
    // The rounded softmax of each vector, then P @ V a chunk of keys at a time for the group
    // (rounded_softmax_pv's sums, in its order).
    const int n = key_end - key_begin;
    for (int v = 0; v < nvec; ++v) {
      float* row = all + static_cast<int64_t>(v) * stride;
      if (p.softcap > 0.0f) soft_cap(row, n, p.softcap);
      rounded_softmax_row(row, n);
    }
    const C* vr[kKeyChunk];
    const C* hr[kKeyChunk];
    for (int start = key_begin; start < key_end; start += kKeyChunk) {
      const int cn = std::min(kKeyChunk, key_end - start);
      for (int t = 0; t < cn; ++t) {
        const int key = start + t;
        vr[t] = vc + (static_cast<int64_t>(blocks[key / p.block_size]) * p.block_size +
                      key % p.block_size) * slot_elems;
      }
      for (int hh = 0; hh < heads; ++hh) {
        for (int t = 0; t < cn; ++t) hr[t] = vr[t] + hh * D;
        const float* w[kMaxVectors];
        for (int g = 0; g < group; ++g)
          w[g] = all + static_cast<int64_t>(hh * group + g) * stride + (start - key_begin);
        shared_pv_group<C, NV>(group, w, hr, cn, acc + hh * group * NV);
      }
    }
    for (int v = 0; v < nvec; ++v) l[v] = 1.0f;  // acc is the output
  } else if (kBf16Scores<T>) {
    int lo[kMaxVectors], hi[kMaxVectors];
    int64_t off[kMaxVectors];
    for (int v = 0; v < nvec; ++v) lo[v] = key_begin, hi[v] = key_end - 1, off[v] = (v / group) * D;
    rounded_softmax_pv<C, NV>(p, nvec, all, stride, key_begin, key_end, lo, hi, off, acc,
                              [&](int start, int n, const C** vr) {
                                for (int t = 0; t < n; ++t) {
                                  const int key = start + t;
                                  vr[t] = vc + (static_cast<int64_t>(blocks[key / p.block_size]) *
                                                    p.block_size + key % p.block_size) * slot_elems;
                                }
                              });
    for (int v = 0; v < nvec; ++v) l[v] = 1.0f;  // acc is the output
  }

  if (part) {  // per vector m, l, then acc: merged by merge_key_splits
    float* dst = p.partials + it.partial;
    for (int v = 0; v < nvec; ++v, dst += D + 2) {
      dst[0] = m[v];
      dst[1] = l[v];
      std::memcpy(dst + 2, acc + v * NV, D * sizeof(float));
    }
    return;
  }
  T* out = static_cast<T*>(p.out) + (q0 + row) * p.out_token_stride;
  for (int v = 0; v < nvec; ++v) {
    const int head = it.head_begin * group + v;
    if (!kBf16Scores<T> && p.sinks != nullptr)
      add_sink(p.sinks[head], m[v], l[v], acc + v * NV, NV);
    T* dst = out + head * p.out_head_stride;
    store_output(dst, acc + v * NV, NV, l[v]);  // l > 0: the max's own term is exp(0)
  }
}
