// Few-query (decode) attention: a handful of query rows against a long KV cache.
//
// sdpa_decode: grid (ceil(G * Lq / R), Hk, B * splits), SDPA_DEC_SG simdgroups. The R packed
// query rows of one threadgroup are (query head of the GQA group, query) pairs sharing one kv
// head, so every K/V row read serves all of them. Simdgroup s takes keys s, s + SG, ... of the
// threadgroup's key range (of its split); each lane holds head-dim elements lane, lane + 32, ...
// and a dot product is one simd_sum. The simdgroups' partial softmax states are merged in
// threadgroup memory. One split writes out + lse; several write unnormalized partials that
// sdpa_decode_combine merges (two-pass split-K for long caches). K/V may be paged (each key's
// row found through the page table, read in place; a page outside the pool is never read).
#include "sdpa_common.metal"

template <typename T, int DMAX, bool CAP>
[[kernel]] void sdpa_decode(device const T* q [[buffer(0)]], device const T* k [[buffer(1)]],
                            device const T* v [[buffer(2)]],
                            device const uchar* mask [[buffer(3)]],
                            device const float* sinks [[buffer(4)]],
                            device const int* q_lengths [[buffer(5)]],
                            device const int* kv_lengths [[buffer(6)]],
                            device const int* q_seg [[buffer(7)]],
                            device const int* kv_seg [[buffer(8)]],
                            device const int* page_indices [[buffer(9)]],
                            device T* out [[buffer(10)]], device float* lse [[buffer(11)]],
                            device float* part_o [[buffer(12)]],
                            device float* part_ml [[buffer(13)]],
                            constant SdpaMetalParams& p [[buffer(14)]],
                            uint3 tgp [[threadgroup_position_in_grid]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint tid [[thread_index_in_threadgroup]]) {
  constexpr int R = SDPA_DEC_ROWS(DMAX);
  constexpr int E = DMAX / SDPA_SIMD;  // head-dim elements per lane
  MSL_TG_ARRAY(float, tg_m, SDPA_DEC_SG * R);
  MSL_TG_ARRAY(float, tg_l, SDPA_DEC_SG * R);
  MSL_TG_ARRAY(float, tg_o, SDPA_DEC_SG * R * DMAX);

  const int nsplit = p.num_splits;
  const int b = int(tgp.z) / nsplit, split = int(tgp.z) % nsplit;
  const int hk = int(tgp.y);
  const int nrows = p.group * p.len_q;
  const int r0 = int(tgp.x) * R;
  const int qlen = sdpa_length(q_lengths, p.has_q_lengths, b, p.len_q);
  const int kvlen = sdpa_length(kv_lengths, p.has_kv_lengths, b, p.len_kv);
  const int off = p.bottom_right != 0 ? kvlen - qlen : 0;
  const bool segs = p.has_segment_ids != 0;

  // Rows: head h = hk * G + r / Lq, query i = r % Lq; live if i < qlen.
  int row_h[R], row_i[R], row_seg[R];
  bool row_live[R];
  float qr[R][E];
  int kbeg = kvlen, kend = 0;
  for (int r = 0; r < R; ++r) {
    const int rr = r0 + r;
    row_h[r] = hk * p.group + (rr < nrows ? rr / p.len_q : 0);
    row_i[r] = rr < nrows ? rr % p.len_q : 0;
    row_live[r] = rr < nrows && row_i[r] < qlen;
    row_seg[r] = (segs && row_live[r]) ? sdpa_seg(q_seg, b, p.len_q, row_i[r]) : 0;
    device const T* qrow =
        q + b * p.q_stride[0] + row_h[r] * p.q_stride[1] + row_i[r] * p.q_stride[2];
    for (int e = 0; e < E; ++e) {
      const int d = int(lane) + e * SDPA_SIMD;
      qr[r][e] = (row_live[r] && d < p.head_dim) ? float(qrow[d]) : 0.0f;
    }
    if (row_live[r]) {
      kbeg = min(kbeg, sdpa_band_first(row_i[r], off, p.window_left));
      kend = max(kend, sdpa_band_last(row_i[r], off, p.window_right, kvlen));
    }
  }
  // This split's share of the key range.
  if (kend > kbeg) {
    const int chunk = (kend - kbeg + nsplit - 1) / nsplit;
    const int lo = kbeg + split * chunk;
    kend = min(kend, lo + chunk);
    kbeg = lo;
  }

  float m[R], l[R], acc[R][E];
  for (int r = 0; r < R; ++r) {
    m[r] = SDPA_NEG_INF;
    l[r] = 0.0f;
    for (int e = 0; e < E; ++e) acc[r][e] = 0.0f;
  }

  device const T* kb = k + hk * p.k_stride[1];  // + sdpa_kv_row
  device const T* vb = v + hk * p.v_stride[1];
  for (int j = kbeg + int(sg); j < kend; j += SDPA_DEC_SG) {
    const long koff = sdpa_kv_row(page_indices, p, b, j, p.k_stride[0], p.k_stride[2]);
    if (koff < 0) continue;  // a page outside the pool: invisible, never read
    const long voff = sdpa_kv_row(page_indices, p, b, j, p.v_stride[0], p.v_stride[2]);
    const int kseg = segs ? sdpa_seg(kv_seg, b, p.len_kv, j) : 0;
    float kr[E], vr[E];
    for (int e = 0; e < E; ++e) {
      const int d = int(lane) + e * SDPA_SIMD;
      kr[e] = d < p.head_dim ? float(kb[koff + d]) : 0.0f;
      vr[e] = d < p.head_dim_v ? float(vb[voff + d]) : 0.0f;
    }
    for (int r = 0; r < R; ++r) {
      // Visibility is uniform over the simdgroup, so the simd_sum below is too.
      if (!row_live[r]) continue;
      const int i = row_i[r];
      if (j < sdpa_band_first(i, off, p.window_left) ||
          j >= sdpa_band_last(i, off, p.window_right, kvlen))
        continue;
      if (segs && row_seg[r] != kseg) continue;
      float madd = 0.0f;
      if (p.mask_kind != SDPA_MASK_NONE) {
        madd = sdpa_mask2(mask, p, b, row_h[r], i, j);
        if (madd == SDPA_NEG_INF) continue;
      }
      float dot = 0.0f;
      for (int e = 0; e < E; ++e) dot += qr[r][e] * kr[e];
      float tc;
      const float s = sdpa_score2<CAP>(simd_sum(dot), p, tc) + madd;
      const float m_new = max(m[r], s);
      const float alpha = sdpa_exp2_safe(m[r], m_new);
      const float pj = sdpa_exp2_safe(s, m_new);
      l[r] = l[r] * alpha + pj;
      for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * alpha + pj * vr[e];
      m[r] = m_new;
    }
  }

  // Merge the simdgroups' states.
  for (int r = 0; r < R; ++r) {
    if (lane == 0) {
      tg_m[sg * R + r] = m[r];
      tg_l[sg * R + r] = l[r];
    }
    for (int e = 0; e < E; ++e) tg_o[(sg * R + r) * DMAX + int(lane) + e * SDPA_SIMD] = acc[r][e];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int x = int(tid); x < R * DMAX; x += SDPA_DEC_SG * SDPA_SIMD) {
    const int r = x / DMAX, d = x % DMAX;
    const int rr = r0 + r;
    if (rr >= nrows || d >= p.head_dim_v) continue;
    float mm = SDPA_NEG_INF;
    for (int s = 0; s < SDPA_DEC_SG; ++s) mm = max(mm, tg_m[s * R + r]);
    float ll = 0.0f, oo = 0.0f;
    for (int s = 0; s < SDPA_DEC_SG; ++s) {
      const float w = sdpa_exp2_safe(tg_m[s * R + r], mm);
      ll += w * tg_l[s * R + r];
      oo += w * tg_o[(s * R + r) * DMAX + d];
    }
    const int h = row_h[r], i = row_i[r];
    const long row = (long(b) * p.heads_q + h) * p.len_q + i;
    if (nsplit > 1) {
      const long slot = row * nsplit + split;
      part_o[slot * p.head_dim_v + d] = oo;
      if (d == 0) {
        part_ml[slot * 2] = mm;
        part_ml[slot * 2 + 1] = ll;
      }
      continue;
    }
    if (p.has_sinks != 0 && row_live[r]) {  // the sink joins as one more column
      const float sk = sinks[b * p.sinks_batch_stride + h] * SDPA_LOG2E;
      const float mn = max(mm, sk);
      const float a = sdpa_exp2_safe(mm, mn);
      ll = ll * a + exp2(sk - mn);
      oo *= a;
      mm = mn;
    }
    const bool live = row_live[r] && sdpa_row_live(ll);
    out[b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2] + d] =
        T(live ? oo / ll : 0.0f);
    if (d == 0) lse[row] = live ? (mm + log2(ll)) * SDPA_LN2 : SDPA_NEG_INF;
  }
}

// Second pass: merges the splits of one output row per simdgroup; adds the sink.
template <typename T>
[[kernel]] void sdpa_decode_combine(device const float* part_o [[buffer(0)]],
                                    device const float* part_ml [[buffer(1)]],
                                    device const float* sinks [[buffer(2)]],
                                    device const int* q_lengths [[buffer(3)]],
                                    device T* out [[buffer(4)]], device float* lse [[buffer(5)]],
                                    constant SdpaMetalParams& p [[buffer(6)]],
                                    uint3 tgp [[threadgroup_position_in_grid]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint tid [[thread_index_in_threadgroup]]) {
  const long row = long(tgp.x) * SDPA_COMBINE_SG + sg;
  const long nrows = long(p.batch) * p.heads_q * p.len_q;
  if (row >= nrows) return;
  const int i = int(row % p.len_q), h = int((row / p.len_q) % p.heads_q);
  const int b = int(row / (long(p.len_q) * p.heads_q));
  const int qlen = sdpa_length(q_lengths, p.has_q_lengths, b, p.len_q);
  const int ns = p.num_splits;
  const bool row_live = i < qlen;
  float mm = SDPA_NEG_INF;
  for (int s = 0; s < ns; ++s) mm = max(mm, part_ml[(row * ns + s) * 2]);
  float sk = SDPA_NEG_INF;
  if (p.has_sinks != 0) sk = sinks[b * p.sinks_batch_stride + h] * SDPA_LOG2E;
  const float mt = max(mm, sk);
  float ll = sdpa_exp2_safe(sk, mt);
  for (int s = 0; s < ns; ++s)
    ll += sdpa_exp2_safe(part_ml[(row * ns + s) * 2], mt) * part_ml[(row * ns + s) * 2 + 1];
  const bool live = row_live && sdpa_row_live(ll);
  const float inv = live ? 1.0f / ll : 0.0f;
  device T* ob = out + b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
  for (int d = int(lane); d < p.head_dim_v; d += SDPA_SIMD) {
    float oo = 0.0f;
    for (int s = 0; s < ns; ++s)
      oo += sdpa_exp2_safe(part_ml[(row * ns + s) * 2], mt) * part_o[(row * ns + s) * p.head_dim_v + d];
    ob[d] = T(oo * inv);
  }
  if (lane == 0) lse[row] = live ? (mt + log2(ll)) * SDPA_LN2 : SDPA_NEG_INF;
}

#define SDPA_DEC_INST(tn, T, D)                                                 \
  MSL_INSTANTIATE_KERNEL("sdpa_decode_" #tn "_" #D, sdpa_decode, T, D, false) \
  MSL_INSTANTIATE_KERNEL("sdpa_decode_" #tn "_" #D "_cap", sdpa_decode, T, D, true)
#define SDPA_DEC_INST_ALL(tn, T)                                                \
  SDPA_DEC_INST(tn, T, 64) SDPA_DEC_INST(tn, T, 128) SDPA_DEC_INST(tn, T, 256) \
  SDPA_DEC_INST(tn, T, 512)                                                     \
  MSL_INSTANTIATE_KERNEL("sdpa_decode_combine_" #tn, sdpa_decode_combine, T)
SDPA_DEC_INST_ALL(f32, float)
SDPA_DEC_INST_ALL(f16, half)
SDPA_DEC_INST_ALL(bf16, bfloat)
