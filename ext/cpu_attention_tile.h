// The paged-attention kernel of tiles of several query rows (prompt chunks with context,
// speculative verification, and any head_dim the one-row kernel has no build for), one of the
// two kernels of ext/cpu_attention.cpp: included there, inside its anonymous namespace, after
// Problem, Item, start_vector / store_output and the bf16 rounding points (finish_scores,
// rounded_softmax_pv).
//
// The tile's query vectors (rows x the item's query heads) walk the request's blocks once, a
// chunk of kKeyChunk keys at a time, each key row brought in once for all the vectors that read
// it (the next chunk's rows prefetched), with an online softmax in fp32; bf16 q keeps every
// score instead and runs the rounded softmax and P . V after the last chunk.
#pragma once

// NV = head_dim / 8 when known at compile time (register-resident rows), 0 = read at run time.
template <typename T, typename C, int NV_FIXED>
TRILLM_INLINE void attend_item(const Problem& p, const Item& it) {
  const int NV = NV_FIXED > 0 ? NV_FIXED : p.head_dim / 8;
  const int D = p.head_dim;
  const int group = p.num_heads / p.num_kv_heads;
  const int heads = it.head_end - it.head_begin;  // kv heads of this item
  const int per_row = heads * group;               // query vectors per query row
  const int q0 = p.query_start_loc[it.req];
  const int query_len = p.query_start_loc[it.req + 1] - q0;
  const int context = p.seq_lens[it.req] - query_len;  // keys before the first query row
  // Vector v: row it.row_begin + v / per_row, query head it.head_begin * group + v % per_row.
  const int nvec = (it.row_end - it.row_begin) * per_row;
  const int key_end = context + it.row_end;  // keys the tile's last row sees
  const int32_t* blocks = p.block_table + static_cast<int64_t>(it.req) * p.block_table_stride;
  const T* q = static_cast<const T*>(p.q);
  const C* kc = static_cast<const C*>(p.k_cache);
  const C* vc = static_cast<const C*>(p.v_cache);
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Per-thread scratch: large stack frames would be probed page by page on every item.
  alignas(32) static thread_local v8f qv[kMaxLanes];   // [nvec][NV], times q_scale<T>
  alignas(32) static thread_local v8f acc[kMaxLanes];  // [nvec][NV]
  float m[kMaxVectors], l[kMaxVectors];
  int limit[kMaxVectors];    // last key position vector v may see
  int lower[kMaxVectors];    // first key position vector v may see (sliding window)
  int64_t off[kMaxVectors];  // vector v's kv head within a cache slot

  for (int v = 0; v < nvec; ++v) {
    const int row = it.row_begin + v / per_row;
    const int head = it.head_begin * group + v % per_row;
    const T* src = q + (q0 + row) * p.q_token_stride + head * p.q_head_stride;
    start_vector(p, src, NV, qv + v * NV, acc + v * NV);
    m[v] = neg_inf;
    l[v] = 0.0f;
    limit[v] = context + row;
    lower[v] = p.window > 0 ? std::max(0, limit[v] - p.window + 1) : 0;
    off[v] = static_cast<int64_t>(head / group) * D;
  }

  // Slot rows of keys start .. start + n (a slot row holds every kv head: contiguous).
  auto slot_rows = [&](int start, int n, const C** kr, const C** vr) {
    int b = start / p.block_size, o = start % p.block_size;
    for (int t = 0; t < n; ++t) {
      const int64_t slot = static_cast<int64_t>(blocks[b]) * p.block_size + o;
      kr[t] = kc + slot * slot_elems;
      vr[t] = vc + slot * slot_elems;
      if (++o == p.block_size) o = 0, ++b;
    }
  };
  const C* kp[kKeyChunk];
  const C* vp[kKeyChunk];
  const C* kn[kKeyChunk];
  const C* vn[kKeyChunk];
  alignas(32) float s[kKeyChunk];
  const int row_bytes = static_cast<int>(slot_elems * sizeof(C));
  const int head_bytes = static_cast<int>(D * sizeof(C));
  // The window's start for the tile's first row: keys before it no row of the tile sees.
  const int key_begin = p.window > 0 ? std::max(0, context + it.row_begin - p.window + 1) : 0;
  // bf16 q: every score kept for the second pass ([nvec][stride], keys key_begin + i).
  const int stride = key_end - key_begin;
  float* all = kBf16Scores<T> ? score_rows(nvec, stride) : nullptr;
  for (int start = key_begin; start < key_end; start += kKeyChunk) {
    const int n = std::min(kKeyChunk, key_end - start);
    slot_rows(start, n, kp, vp);
    // Prefetch the next chunk's rows (only this item's heads).
    const int next_n = std::min(kKeyChunk, key_end - start - n);
    slot_rows(start + n, next_n, kn, vn);
    const int first = it.head_begin * head_bytes, last = it.head_end * head_bytes;
    for (int t = 0; t < next_n; ++t) {
      const char* kr = reinterpret_cast<const char*>(kn[t]);
      const char* vr = reinterpret_cast<const char*>(vn[t]);
      for (int b = first; b < last && b < row_bytes; b += 64) {
        __builtin_prefetch(kr + b);
        __builtin_prefetch(vr + b);
      }
    }
    for (int v = 0; v < nvec; ++v) {
      const v8f* qrow = qv + v * NV;
      const int64_t h = off[v];
      // Scores, eight keys at a time (independent accumulators, one tree reduction). Past the
      // chunk's end the last key is read again; those lanes are masked below.
      for (int t = 0; t < n; t += 8) {
        const C* k[8];
        for (int i = 0; i < 8; ++i) k[i] = kp[std::min(t + i, n - 1)] + h;
        v8f a[8];
        for (int i = 0; i < 8; ++i) a[i] = splat(0.0f);
        for (int j = 0; j < NV; ++j) {
          const v8f qj = qrow[j];
          for (int i = 0; i < 8; ++i) a[i] += qj * load8(k[i] + 8 * j);
        }
        const v8f sums = finish_scores<T>(sum_lanes8(a), p);
        std::memcpy(s + t, &sums, sizeof(sums));
      }
      if (kBf16Scores<T>) {  // softmax and P @ V after the last chunk
        std::memcpy(all + static_cast<int64_t>(v) * stride + (start - key_begin), s,
                    n * sizeof(float));
        continue;
      }
      // Causal limit, and -inf padding up to the chunk size; the window's lower bound.
      const int visible = std::max(0, std::min(n, limit[v] - start + 1));
      const int hidden = std::min(visible, std::max(0, lower[v] - start));
      if (visible == hidden) continue;  // nothing this row may see in this chunk
      if (p.softcap > 0.0f) soft_cap(s + hidden, visible - hidden, p.softcap);
      for (int u = 0; u < hidden; ++u) s[u] = neg_inf;
      for (int u = visible; u < kKeyChunk; ++u) s[u] = neg_inf;
      float chunk_max = m[v];
      for (int g = 0; g < kKeyChunk / 8; ++g) chunk_max = std::max(chunk_max, hmax(load8(s + 8 * g)));
      const float correction = std::exp(m[v] - chunk_max);  // 0 the first time (m = -inf)
      v8f sum8 = splat(0.0f);
      for (int g = 0; g < kKeyChunk / 8; ++g) {
        const v8f e = exp_nonpositive(load8(s + 8 * g) - splat(chunk_max));
        std::memcpy(s + 8 * g, &e, sizeof(e));
        sum8 += e;
      }
      l[v] = l[v] * correction + hsum(sum8);
      m[v] = chunk_max;
      // acc = acc * correction + sum_t w_t v_t, the row kept in registers when NV is fixed.
      v8f r[NV_FIXED > 0 ? NV_FIXED : kMaxHeadDim / 8];
      v8f* a = acc + v * NV;
      for (int j = 0; j < NV; ++j) r[j] = a[j] * splat(correction);
      for (int u = 0; u < visible; ++u) {
        const v8f w = splat(s[u]);
        const C* val = vp[u] + h;
        for (int j = 0; j < NV; ++j) r[j] += w * load8(val + 8 * j);
      }
      for (int j = 0; j < NV; ++j) a[j] = r[j];
    }
  }
  if (kBf16Scores<T>) {
    rounded_softmax_pv<C, NV_FIXED>(p, nvec, all, stride, key_begin, key_end, lower, limit, off,
                                    acc, [&](int start, int n, const C** vr) {
                                      const C* kr[kKeyChunk];
                                      slot_rows(start, n, kr, vr);
                                    });
    for (int v = 0; v < nvec; ++v) l[v] = 1.0f;  // acc is the output
  }

  T* out = static_cast<T*>(p.out);
  for (int v = 0; v < nvec; ++v) {
    const int row = it.row_begin + v / per_row;
    const int head = it.head_begin * group + v % per_row;
    T* dst = out + (q0 + row) * p.out_token_stride + head * p.out_head_stride;
    store_output(dst, acc + v * NV, NV, l[v]);  // l >= 1: a row always sees its own key
  }
}
