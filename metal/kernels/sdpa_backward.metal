// Tiled backward from the forward's lse (the forward is never recomputed):
//   P = exp(s - lse), dP = dout v^T, dS = P * (dP - delta), delta_i = dout_i . out_i
//   dq = scale * dS k,  dk = scale * dS^T q,  dv = P^T dout   (summed over the GQA group)
// sdpa_bwd_delta: one row per simdgroup. sdpa_bwd_dq: like the forward, 8 query rows per
// simdgroup over their visible key blocks. sdpa_bwd_dkdv: 8 keys per simdgroup over the query
// heads of their GQA group and the query blocks that can see them (transposed tiles), so every
// output element has exactly one writer and no atomics are needed. With segment ids, tiles
// whose id ranges can't meet are skipped. Soft-capping (the CAP kernels) multiplies dS by
// 1 - tanh^2 before the dq / dk products.
#include "sdpa_common.metal"

template <typename T>
[[kernel]] void sdpa_bwd_delta(device const T* out [[buffer(0)]],
                               device const T* dout [[buffer(1)]],
                               device float* delta [[buffer(2)]],
                               constant SdpaMetalParams& p [[buffer(3)]],
                               uint3 tgp [[threadgroup_position_in_grid]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]],
                               uint tid [[thread_index_in_threadgroup]]) {
  const long row = long(tgp.x) * SDPA_TILED_SG + sg;
  if (row >= long(p.batch) * p.heads_q * p.len_q) return;
  const int i = int(row % p.len_q), h = int((row / p.len_q) % p.heads_q);
  const int b = int(row / (long(p.len_q) * p.heads_q));
  const long base = b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
  float acc = 0.0f;
  for (int d = int(lane); d < p.head_dim_v; d += SDPA_SIMD)
    acc += float(out[base + d]) * float(dout[base + d]);
  acc = simd_sum(acc);
  if (lane == 0) delta[row] = acc;
}

template <typename T, int DMAX, bool CAP>
[[kernel]] void sdpa_bwd_dq(device const T* q [[buffer(0)]], device const T* k [[buffer(1)]],
                            device const T* v [[buffer(2)]],
                            device const uchar* mask [[buffer(3)]],
                            device const int* q_lengths [[buffer(4)]],
                            device const int* kv_lengths [[buffer(5)]],
                            device const int* q_seg [[buffer(6)]],
                            device const int* kv_seg [[buffer(7)]],
                            device const T* dout [[buffer(8)]],
                            device const float* lse [[buffer(9)]],
                            device const float* delta [[buffer(10)]],
                            device T* dq [[buffer(11)]],
                            constant SdpaMetalParams& p [[buffer(12)]],
                            uint3 tgp [[threadgroup_position_in_grid]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint tid [[thread_index_in_threadgroup]]) {
  constexpr int NC = DMAX / 8;
  const int b = int(tgp.z), h = int(tgp.y), hk = h / p.group;
  const int row0 = int(tgp.x) * SDPA_TILED_ROWS + int(sg) * 8;
  if (row0 >= p.len_q) return;
  const int qlen = sdpa_length(q_lengths, p.has_q_lengths, b, p.len_q);
  const int kvlen = sdpa_length(kv_lengths, p.has_kv_lengths, b, p.len_kv);
  const int off = p.bottom_right != 0 ? kvlen - qlen : 0;
  const int nd = p.head_dim / 8, ndv = p.head_dim_v / 8;
  const int i = row0 + sdpa_frag_row(lane);
  const int fc = sdpa_frag_col(lane);

  device const T* qb = q + b * p.q_stride[0] + h * p.q_stride[1];
  device const T* kb = k + b * p.k_stride[0] + hk * p.k_stride[1];
  device const T* vb = v + b * p.v_stride[0] + hk * p.v_stride[1];
  device const T* dob = dout + b * p.o_stride[0] + h * p.o_stride[1];
  const long lrow = (long(b) * p.heads_q + h) * p.len_q;
  // Row statistics; lse = -inf (nothing visible) makes every P of the row 0.
  const float lse2 = i < qlen ? lse[lrow + i] * SDPA_LOG2E : SDPA_NEG_INF;
  const float dlt = i < qlen ? delta[lrow + i] : 0.0f;

  int kbeg = 0, kend = 0;
  if (row0 < qlen) {
    kbeg = sdpa_band_first(row0, off, p.window_left);
    kend = sdpa_band_last(min(row0 + 8, qlen) - 1, off, p.window_right, kvlen);
  }
  const bool segs = p.has_segment_ids != 0;
  SdpaSegRange rows_seg = {0, 0};
  if (segs) rows_seg = sdpa_seg_range(q_seg, b, p.len_q, row0, min(row0 + 8, qlen) - row0, lane);
  simdgroup_float8x8 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int j0 = kbeg; j0 < kend; j0 += 8) {
    if (segs && !sdpa_seg_meet(rows_seg,
                               sdpa_seg_range(kv_seg, b, p.len_kv, j0, min(8, kend - j0), lane)))
      continue;
    simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int c = 0; c < nd; ++c) {
      simdgroup_float8x8 qf, kt;
      sdpa_load(qf, qb, p.q_stride[2], row0, p.len_q, c * 8, lane);
      sdpa_load_t(kt, kb, p.k_stride[2], j0, kend, c * 8, lane);
      simdgroup_multiply_accumulate(s, qf, kt, s);
    }
    simdgroup_float8x8 dp = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int c = 0; c < ndv; ++c) {
      simdgroup_float8x8 df, vt;
      sdpa_load(df, dob, p.o_stride[2], row0, p.len_q, c * 8, lane);
      sdpa_load_t(vt, vb, p.v_stride[2], j0, kend, c * 8, lane);
      simdgroup_multiply_accumulate(dp, df, vt, dp);
    }
    for (int e = 0; e < 2; ++e) {
      const int j = j0 + fc + e;
      float tc = 0.0f;
      const float x = sdpa_logit2<CAP>(s.thread_elements()[e], mask, q_seg, kv_seg, p, b, h, i,
                                       j, qlen, kvlen, off, j < kend, tc);
      const float pe = sdpa_exp2_prob(x, lse2);
      // dS, selected: a hidden key's dP may be NaN (a NaN value) and 0 * NaN is NaN
      s.thread_elements()[e] =
          pe == 0.0f ? 0.0f : pe * (dp.thread_elements()[e] - dlt) * (CAP ? 1.0f - tc * tc : 1.0f);
    }
    for (int c = 0; c < NC; ++c) {
      if (c < nd) {
        simdgroup_float8x8 kf;
        sdpa_load(kf, kb, p.k_stride[2], j0, kend, c * 8, lane);
        sdpa_mma_select(acc[c], s, kf, lane);
      }
    }
  }
  device T* dqb = dq + b * p.q_stride[0] + h * p.q_stride[1];
  for (int c = 0; c < NC; ++c)
    if (c < nd) sdpa_store(acc[c], dqb, p.q_stride[2], row0, p.len_q, c * 8, p.scale, lane);
}

template <typename T, int DMAX, bool CAP>
[[kernel]] void sdpa_bwd_dkdv(device const T* q [[buffer(0)]], device const T* k [[buffer(1)]],
                              device const T* v [[buffer(2)]],
                              device const uchar* mask [[buffer(3)]],
                              device const int* q_lengths [[buffer(4)]],
                              device const int* kv_lengths [[buffer(5)]],
                              device const int* q_seg [[buffer(6)]],
                              device const int* kv_seg [[buffer(7)]],
                              device const T* dout [[buffer(8)]],
                              device const float* lse [[buffer(9)]],
                              device const float* delta [[buffer(10)]],
                              device T* dk [[buffer(11)]], device T* dv [[buffer(12)]],
                              constant SdpaMetalParams& p [[buffer(13)]],
                              uint3 tgp [[threadgroup_position_in_grid]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint tid [[thread_index_in_threadgroup]]) {
  constexpr int NC = DMAX / 8;
  const int b = int(tgp.z), hk = int(tgp.y);
  const int key0 = int(tgp.x) * SDPA_TILED_ROWS + int(sg) * 8;
  if (key0 >= p.len_kv) return;
  const int qlen = sdpa_length(q_lengths, p.has_q_lengths, b, p.len_q);
  const int kvlen = sdpa_length(kv_lengths, p.has_kv_lengths, b, p.len_kv);
  const int off = p.bottom_right != 0 ? kvlen - qlen : 0;
  const int nd = p.head_dim / 8, ndv = p.head_dim_v / 8;
  const int j = key0 + sdpa_frag_row(lane);  // this lane's key (tile row)
  const int fc = sdpa_frag_col(lane);        // its query columns fc, fc + 1

  device const T* kb = k + b * p.k_stride[0] + hk * p.k_stride[1];
  device const T* vb = v + b * p.v_stride[0] + hk * p.v_stride[1];

  // Queries that can see any of keys [key0, klast]: d = j - (i + off) in [-wl, wr].
  int qbeg = 0, qend = 0;
  if (key0 < kvlen) {
    const int klast = min(key0 + 8, kvlen) - 1;
    qbeg = p.window_right < 0 ? 0 : max(0, key0 - off - p.window_right);
    qend = p.window_left < 0 ? qlen : min(qlen, max(0, klast - off + p.window_left + 1));
  }
  const bool segs = p.has_segment_ids != 0;
  SdpaSegRange keys_seg = {0, 0};
  if (segs)
    keys_seg = sdpa_seg_range(kv_seg, b, p.len_kv, key0, min(key0 + 8, kvlen) - key0, lane);
  simdgroup_float8x8 gk[NC], gv[NC];
  for (int c = 0; c < NC; ++c) {
    gk[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    gv[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  for (int g = 0; g < p.group; ++g) {
    const int h = hk * p.group + g;
    device const T* qb = q + b * p.q_stride[0] + h * p.q_stride[1];
    device const T* dob = dout + b * p.o_stride[0] + h * p.o_stride[1];
    const long lrow = (long(b) * p.heads_q + h) * p.len_q;
    for (int i0 = qbeg; i0 < qend; i0 += 8) {
      if (segs && !sdpa_seg_meet(keys_seg, sdpa_seg_range(q_seg, b, p.len_q, i0,
                                                          min(8, qend - i0), lane)))
        continue;
      // S^T = K Q^T and dP^T = V dO^T: rows are keys, columns queries.
      simdgroup_float8x8 st = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int c = 0; c < nd; ++c) {
        simdgroup_float8x8 kf, qt;
        sdpa_load(kf, kb, p.k_stride[2], key0, kvlen, c * 8, lane);
        sdpa_load_t(qt, qb, p.q_stride[2], i0, qend, c * 8, lane);
        simdgroup_multiply_accumulate(st, kf, qt, st);
      }
      simdgroup_float8x8 dpt = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int c = 0; c < ndv; ++c) {
        simdgroup_float8x8 vf, dot;
        sdpa_load(vf, vb, p.v_stride[2], key0, kvlen, c * 8, lane);
        sdpa_load_t(dot, dob, p.o_stride[2], i0, qend, c * 8, lane);
        simdgroup_multiply_accumulate(dpt, vf, dot, dpt);
      }
      simdgroup_float8x8 pt, dst;
      for (int e = 0; e < 2; ++e) {
        const int i = i0 + fc + e;
        float pe = 0.0f, dlt = 0.0f, tc = 0.0f;
        if (i < qend) {
          const float x = sdpa_logit2<CAP>(st.thread_elements()[e], mask, q_seg, kv_seg, p, b, h,
                                           i, j, qlen, kvlen, off, true, tc);
          pe = sdpa_exp2_prob(x, lse[lrow + i] * SDPA_LOG2E);
          dlt = delta[lrow + i];
        }
        pt.thread_elements()[e] = pe;
        dst.thread_elements()[e] =
            pe == 0.0f ? 0.0f
                       : pe * (dpt.thread_elements()[e] - dlt) * (CAP ? 1.0f - tc * tc : 1.0f);
      }
      for (int c = 0; c < NC; ++c) {
        if (c < ndv) {
          simdgroup_float8x8 df;
          sdpa_load(df, dob, p.o_stride[2], i0, qend, c * 8, lane);
          sdpa_mma_select(gv[c], pt, df, lane);
        }
        if (c < nd) {
          simdgroup_float8x8 qf;
          sdpa_load(qf, qb, p.q_stride[2], i0, qend, c * 8, lane);
          sdpa_mma_select(gk[c], dst, qf, lane);
        }
      }
    }
  }
  device T* dkb = dk + b * p.k_stride[0] + hk * p.k_stride[1];
  device T* dvb = dv + b * p.v_stride[0] + hk * p.v_stride[1];
  for (int c = 0; c < NC; ++c) {
    if (c < nd) sdpa_store(gk[c], dkb, p.k_stride[2], key0, p.len_kv, c * 8, p.scale, lane);
    if (c < ndv) sdpa_store(gv[c], dvb, p.v_stride[2], key0, p.len_kv, c * 8, 1.0f, lane);
  }
}

#define SDPA_BWD_INST(tn, T, D)                                                         \
  MSL_INSTANTIATE_KERNEL("sdpa_bwd_dq_" #tn "_" #D, sdpa_bwd_dq, T, D, false)         \
  MSL_INSTANTIATE_KERNEL("sdpa_bwd_dq_" #tn "_" #D "_cap", sdpa_bwd_dq, T, D, true)   \
  MSL_INSTANTIATE_KERNEL("sdpa_bwd_dkdv_" #tn "_" #D, sdpa_bwd_dkdv, T, D, false)     \
  MSL_INSTANTIATE_KERNEL("sdpa_bwd_dkdv_" #tn "_" #D "_cap", sdpa_bwd_dkdv, T, D, true)
#define SDPA_BWD_INST_ALL(tn, T)                                                \
  SDPA_BWD_INST(tn, T, 64) SDPA_BWD_INST(tn, T, 128) SDPA_BWD_INST(tn, T, 256) \
  SDPA_BWD_INST(tn, T, 512)                                                     \
  MSL_INSTANTIATE_KERNEL("sdpa_bwd_delta_" #tn, sdpa_bwd_delta, T)
SDPA_BWD_INST_ALL(f32, float)
SDPA_BWD_INST_ALL(f16, half)
SDPA_BWD_INST_ALL(bf16, bfloat)
