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
//
// Within a chunk the vectors are taken kv head by kv head, row by row, in groups of up to
// kTileGroup vectors of one kv head, in two passes: (1) every group's scores of the chunk, eight
// keys at a time (group_scores: each key chunk loaded feeds every vector of the group; the
// chunk's keys stay in L1 for all the groups); (2) group by group, each vector's online-softmax
// update on its own (its causal limit and window), then P . V for the group (group_pv: each
// value chunk loaded feeds every vector) over the keys all its live vectors see, and each vector
// alone over the rest of its own. Only the loop nest changed from one vector at a time: every
// score and every output lane is accumulated in the same order as before (bit-identical
// outputs, checked over 2,575 configurations at 1 and 2 threads, AVX2 and generic builds). One
// thread, benchmarks/kernels/attention_tile.py (8 / 4 heads of 64): a 256-token chunk over 0, 256 and
// 1024 keys took 1.64 / 4.56 / 14.2 ms against 1.92 / 5.46 / 17.1 before (x0.85 / 0.83 / 0.83).
#pragma once

constexpr int kTileGroup = 4;  // query vectors of one kv head taken together

// Scores of eight keys (k[0..7], this group's kv head) for the G query vectors qrow[0..G): vector
// g's score of key i is one FMA chain over j (a = 0; a += q_g[j] * k_i[j], j ascending), then one
// transposing add tree per vector (sum_lanes8), into dst[g][0..8). The keys are taken KB at a
// time so that G x KB accumulators, G q chunks and one k chunk stay in registers: each k chunk
// loaded feeds G FMAs, each q chunk KB.
template <typename T, typename C, int NV_FIXED, int G, int KB>
TRILLM_INLINE void group_scores(const Problem& p, int NV, const v8f* const* qrow,
                                const C* const* k, float* const* dst) {
  v8f a[G][8];
  for (int i0 = 0; i0 < 8; i0 += KB) {
    v8f x[G][KB];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < KB; ++i) x[g][i] = splat(0.0f);
    for (int j = 0; j < NV; ++j) {
      v8f qj[G];
      for (int g = 0; g < G; ++g) qj[g] = qrow[g][j];
      for (int i = 0; i < KB; ++i) {
        const v8f kj = load8(k[i0 + i] + 8 * j);
        for (int g = 0; g < G; ++g) x[g][i] += qj[g] * kj;
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < KB; ++i) a[g][i0 + i] = x[g][i];
  }
  for (int g = 0; g < G; ++g) {
    const v8f sums = finish_scores<T>(sum_lanes8(a[g]), p);
    std::memcpy(dst[g], &sums, sizeof(sums));
  }
}

// {x[0], ..., x[0]} (x[1 .. 8) readable): lane 0 of a plain load, shuffled to every lane, which
// the compiler emits as one broadcast load (splat of a loaded float came out lane by lane).
TRILLM_INLINE v8f broadcast(const float* x) {
  const v8f t = load8(x);
  return TRILLM_SHUFFLE(t, t, 0, 0, 0, 0, 0, 0, 0, 0);
}

// Lanes j0 .. j0 + JB of the acc rows of G vectors: r = acc * corr[g] (corr null: r = acc), then
// r += w[g][u] * v_u (v_u = vr[u] + h) for u = u0 .. u1 - 1 in that order. Each value chunk
// loaded feeds G FMAs.
template <typename C, int G, int JB>
TRILLM_INLINE void pv_lanes(int j0, v8f* const* arow, const float* corr, const float* const* w,
                            const C* const* vr, int64_t h, int u0, int u1) {
  v8f r[G][JB];
  for (int g = 0; g < G; ++g)
    for (int jj = 0; jj < JB; ++jj)
      r[g][jj] = corr ? arow[g][j0 + jj] * splat(corr[g]) : arow[g][j0 + jj];
  for (int u = u0; u < u1; ++u) {
    v8f wu[G];
    for (int g = 0; g < G; ++g) wu[g] = broadcast(w[g] + u);
    const C* val = vr[u] + h + 8 * j0;
    for (int jj = 0; jj < JB; ++jj) {
      const v8f x = load8(val + 8 * jj);
      for (int g = 0; g < G; ++g) r[g][jj] += wu[g] * x;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int jj = 0; jj < JB; ++jj) arow[g][j0 + jj] = r[g][jj];
}

template <typename C, int G, int JB>
TRILLM_INLINE void group_pv(int NV, v8f* const* arow, const float* corr, const float* const* w,
                            const C* const* vr, int64_t h, int u0, int u1) {
  int j0 = 0;
  for (; j0 + JB <= NV; j0 += JB) pv_lanes<C, G, JB>(j0, arow, corr, w, vr, h, u0, u1);
  for (; j0 < NV; ++j0) pv_lanes<C, G, 1>(j0, arow, corr, w, vr, h, u0, u1);
}

// The two above for a run-time group size cnt in 1 .. kTileGroup (no lambdas: a lambda would not
// take the ISA of the target-specific function it is inlined into).
template <typename T, typename C, int NV_FIXED, int KB>
TRILLM_INLINE void scores_of(int cnt, const Problem& p, int NV, const v8f* const* qrow,
                             const C* const* k, float* const* dst) {
  switch (cnt) {
    case 1: return group_scores<T, C, NV_FIXED, 1, KB>(p, NV, qrow, k, dst);
    case 2: return group_scores<T, C, NV_FIXED, 2, KB>(p, NV, qrow, k, dst);
    case 3: return group_scores<T, C, NV_FIXED, 3, KB>(p, NV, qrow, k, dst);
    default: return group_scores<T, C, NV_FIXED, 4, KB>(p, NV, qrow, k, dst);
  }
}

template <typename C, int JB>
TRILLM_INLINE void pv_of(int cnt, int NV, v8f* const* arow, const float* corr,
                         const float* const* w, const C* const* vr, int64_t h, int u0, int u1) {
  switch (cnt) {
    case 1: return group_pv<C, 1, JB>(NV, arow, corr, w, vr, h, u0, u1);
    case 2: return group_pv<C, 2, JB>(NV, arow, corr, w, vr, h, u0, u1);
    case 3: return group_pv<C, 3, JB>(NV, arow, corr, w, vr, h, u0, u1);
    default: return group_pv<C, 4, JB>(NV, arow, corr, w, vr, h, u0, u1);
  }
}

// NV = head_dim / 8 when known at compile time (register-resident rows), 0 = read at run time.
// KB: keys per block of score accumulators, JB: value lanes (x 8) per block of P . V
// accumulators; chosen per build so that the accumulators of a group stay in registers.
template <typename T, typename C, int NV_FIXED, int KB, int JB>
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
  const int rows = it.row_end - it.row_begin;
  const int nvec = rows * per_row;
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
  // The vectors kv head by kv head (row by row within one), cut into groups of up to
  // kTileGroup: group c is order[first[c] .. first[c + 1]).
  int order[kMaxVectors];
  int first[kMaxVectors + 1];
  int num_groups = 0;
  for (int hh = 0, k = 0; hh < heads; ++hh) {
    const int begin = k;
    for (int r = 0; r < rows; ++r)
      for (int gi = 0; gi < group; ++gi) order[k++] = r * per_row + hh * group + gi;
    for (int b = begin; b < k; b += kTileGroup) first[num_groups++] = b;
    first[num_groups] = k;
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
  // Vector v's scores of the chunk, then its weights (8 floats of padding, never written:
  // broadcast reads 8 from any weight).
  alignas(32) static thread_local float s[kMaxVectors][kKeyChunk + 8];
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
    const int first_byte = it.head_begin * head_bytes, last_byte = it.head_end * head_bytes;
    for (int t = 0; t < next_n; ++t) {
      const char* kr = reinterpret_cast<const char*>(kn[t]);
      const char* vr = reinterpret_cast<const char*>(vn[t]);
      for (int b = first_byte; b < last_byte && b < row_bytes; b += 64) {
        __builtin_prefetch(kr + b);
        __builtin_prefetch(vr + b);
      }
    }
    // (1) Every vector's scores of the chunk, group by group (the chunk's keys stay in L1 for
    // all the groups, not evicted by its values in between), eight keys at a time. Past the
    // chunk's end the last key is read again; those lanes are masked below.
    for (int c = 0; c < num_groups; ++c) {
      const int* vs = order + first[c];
      const int cnt = first[c + 1] - first[c];
      const int64_t h = off[vs[0]];  // one kv head for the whole group
      const v8f* qrow[kTileGroup];
      float* dst[kTileGroup];
      for (int g = 0; g < cnt; ++g) qrow[g] = qv + vs[g] * NV;
      for (int t = 0; t < n; t += 8) {
        const C* k[8];
        for (int i = 0; i < 8; ++i) k[i] = kp[std::min(t + i, n - 1)] + h;
        for (int g = 0; g < cnt; ++g) dst[g] = s[vs[g]] + t;
        scores_of<T, C, NV_FIXED, KB>(cnt, p, NV, qrow, k, dst);
      }
    }
    if (kBf16Scores<T>) {  // softmax and P @ V after the last chunk
      for (int v = 0; v < nvec; ++v)
        std::memcpy(all + static_cast<int64_t>(v) * stride + (start - key_begin), s[v],
                    n * sizeof(float));
      continue;
    }
    // (2) Group by group: each vector's online-softmax update; those that see keys of this
    // chunk (live of them, weights w, keys 0 .. visible) take part in P . V.
    for (int c = 0; c < num_groups; ++c) {
      const int* vs = order + first[c];
      const int cnt = first[c + 1] - first[c];
      const int64_t h = off[vs[0]];
      v8f* arow[kTileGroup];
      const float* w[kTileGroup];
      float corr[kTileGroup];
      int seen[kTileGroup];
      int live = 0, common = kKeyChunk;
      for (int g = 0; g < cnt; ++g) {
        const int v = vs[g];
        float* sv = s[v];
        // Causal limit, and -inf padding up to the chunk size; the window's lower bound.
        const int visible = std::max(0, std::min(n, limit[v] - start + 1));
        const int hidden = std::min(visible, std::max(0, lower[v] - start));
        if (visible == hidden) continue;  // nothing this row may see in this chunk
        if (p.softcap > 0.0f) soft_cap(sv + hidden, visible - hidden, p.softcap);
        for (int u = 0; u < hidden; ++u) sv[u] = neg_inf;
        for (int u = visible; u < kKeyChunk; ++u) sv[u] = neg_inf;
        float chunk_max = m[v];
        for (int b = 0; b < kKeyChunk / 8; ++b)
          chunk_max = std::max(chunk_max, hmax(load8(sv + 8 * b)));
        const float correction = std::exp(m[v] - chunk_max);  // 0 the first time (m = -inf)
        v8f sum8 = splat(0.0f);
        for (int b = 0; b < kKeyChunk / 8; ++b) {
          const v8f e = exp_nonpositive(load8(sv + 8 * b) - splat(chunk_max));
          std::memcpy(sv + 8 * b, &e, sizeof(e));
          sum8 += e;
        }
        l[v] = l[v] * correction + hsum(sum8);
        m[v] = chunk_max;
        arow[live] = acc + v * NV;
        w[live] = sv;
        corr[live] = correction;
        seen[live] = visible;
        common = std::min(common, visible);
        ++live;
      }
      if (live == 0) continue;
      // acc = acc * correction + sum_u w_u v_u (u ascending, hidden keys' weights 0): keys
      // 0 .. common for the group, then each vector's own rest.
      pv_of<C, JB>(live, NV, arow, corr, w, vp, h, 0, common);
      for (int g = 0; g < live; ++g) {
        if (seen[g] > common) pv_of<C, JB>(1, NV, arow + g, nullptr, w + g, vp, h, common, seen[g]);
      }
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
    if (!kBf16Scores<T> && p.sinks != nullptr)
      add_sink(p.sinks[head], m[v], l[v], acc + v * NV, NV);
    T* dst = out + (q0 + row) * p.out_token_stride + head * p.out_head_stride;
    store_output(dst, acc + v * NV, NV, l[v]);  // l > 0: a row always sees its own key
  }
}
