// Tiled full-attention forward: out = softmax(scale * q k^T + mask) v and lse, flash style.
// Grid (ceil(Lq / 32), Hq, B), 4 simdgroups; each simdgroup owns 8 query rows and walks its
// visible key blocks (the band of its rows, so causal blocks above the diagonal are skipped,
// and with segment ids the blocks whose ids can't meet the rows') with 8x8 simdgroup_matrix
// tiles and an online softmax in float32 (base 2). K/V may be paged (read in place).
// Simdgroups are independent: no threadgroup memory and no barriers.
#include "sdpa_common.metal"

template <typename T, int DMAX, bool CAP>
[[kernel]] void sdpa_fwd(device const T* q [[buffer(0)]], device const T* k [[buffer(1)]],
                         device const T* v [[buffer(2)]], device const uchar* mask [[buffer(3)]],
                         device const float* sinks [[buffer(4)]],
                         device const int* q_lengths [[buffer(5)]],
                         device const int* kv_lengths [[buffer(6)]],
                         device const int* q_seg [[buffer(7)]],
                         device const int* kv_seg [[buffer(8)]],
                         device const int* page_indices [[buffer(9)]],
                         device T* out [[buffer(10)]], device float* lse [[buffer(11)]],
                         constant SdpaMetalParams& p [[buffer(12)]],
                         uint3 tgp [[threadgroup_position_in_grid]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint tid [[thread_index_in_threadgroup]]) {
  constexpr int NT = SDPA_FWD_BK / 8;  // key tiles per step
  constexpr int NC = DMAX / 8;         // column tiles of the widest head dim
  const int b = int(tgp.z), h = int(tgp.y), hk = h / p.group;
  const int row0 = int(tgp.x) * SDPA_TILED_ROWS + int(sg) * 8;
  if (row0 >= p.len_q) return;  // uniform per simdgroup
  const int qlen = sdpa_length(q_lengths, p.has_q_lengths, b, p.len_q);
  const int kvlen = sdpa_length(kv_lengths, p.has_kv_lengths, b, p.len_kv);
  const int off = p.bottom_right != 0 ? kvlen - qlen : 0;
  const int nd = p.head_dim / 8, ndv = p.head_dim_v / 8;
  const int i = row0 + sdpa_frag_row(lane);  // this lane's query row
  const int fc = sdpa_frag_col(lane);
  const bool segs = p.has_segment_ids != 0;

  device const T* qb = q + b * p.q_stride[0] + h * p.q_stride[1];
  device const T* kb = k + hk * p.k_stride[1];  // + sdpa_kv_row
  device const T* vb = v + hk * p.v_stride[1];

  // Keys the 8 rows can see: band_first/last grow with the row, so the union is
  // [first(row0), last(last valid row)).
  int kbeg = 0, kend = 0;
  if (row0 < qlen) {
    kbeg = sdpa_band_first(row0, off, p.window_left);
    kend = sdpa_band_last(min(row0 + 8, qlen) - 1, off, p.window_right, kvlen);
  }
  SdpaSegRange rows_seg = {0, 0};
  if (segs) rows_seg = sdpa_seg_range(q_seg, b, p.len_q, row0, min(row0 + 8, qlen) - row0, lane);

  // Running max and sum (base 2); a sink starts the row at its logit with mass 1.
  float m_run = SDPA_NEG_INF, l_run = 0.0f;
  if (p.has_sinks != 0) {
    m_run = sinks[b * p.sinks_batch_stride + h] * SDPA_LOG2E;
    l_run = 1.0f;
  }
  simdgroup_float8x8 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int j0 = kbeg; j0 < kend; j0 += SDPA_FWD_BK) {
    if (segs && !sdpa_seg_meet(rows_seg, sdpa_seg_range(kv_seg, b, p.len_kv, j0,
                                                        min(SDPA_FWD_BK, kend - j0), lane)))
      continue;  // no key of the block shares a segment with the rows
    // Row offsets of this lane's keys: K^T columns (t, e) and V rows t; -1 past kend or on
    // a page outside the pool (never read).
    long koff[NT][2], voff[NT];
    for (int t = 0; t < NT; ++t) {
      for (int e = 0; e < 2; ++e) {
        const int j = j0 + t * 8 + fc + e;
        koff[t][e] = j < kend ? sdpa_kv_row(page_indices, p, b, j, p.k_stride[0], p.k_stride[2])
                              : -1;
      }
      const int jr = j0 + t * 8 + sdpa_frag_row(lane);
      voff[t] = jr < kend ? sdpa_kv_row(page_indices, p, b, jr, p.v_stride[0], p.v_stride[2])
                          : -1;
    }
    simdgroup_float8x8 s[NT];
    for (int t = 0; t < NT; ++t) s[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int c = 0; c < nd; ++c) {
      simdgroup_float8x8 qf;
      sdpa_load(qf, qb, p.q_stride[2], row0, p.len_q, c * 8, lane);
      for (int t = 0; t < NT; ++t) {
        simdgroup_float8x8 kt;
        sdpa_load_kv_t(kt, kb, koff[t], c * 8, lane);
        simdgroup_multiply_accumulate(s[t], qf, kt, s[t]);
      }
    }
    // Logits, block max, probabilities.
    float mx = SDPA_NEG_INF;
    for (int t = 0; t < NT; ++t) {
      for (int e = 0; e < 2; ++e) {
        const int j = j0 + t * 8 + fc + e;
        float tc;
        const float x = sdpa_logit2<CAP>(s[t].thread_elements()[e], mask, q_seg, kv_seg, p, b,
                                         h, i, j, qlen, kvlen, off, koff[t][e] >= 0, tc);
        s[t].thread_elements()[e] = x;
        mx = max(mx, x);
      }
    }
    const float m_new = max(m_run, sdpa_row_max(mx));
    const float alpha = sdpa_exp2_safe(m_run, m_new);
    float rs = 0.0f;
    for (int t = 0; t < NT; ++t) {
      for (int e = 0; e < 2; ++e) {
        const float pe = sdpa_exp2_safe(s[t].thread_elements()[e], m_new);
        s[t].thread_elements()[e] = pe;
        rs += pe;
      }
    }
    l_run = l_run * alpha + sdpa_row_sum(rs);
    m_run = m_new;
    for (int c = 0; c < NC; ++c) {
      if (c < ndv) {
        acc[c].thread_elements()[0] *= alpha;
        acc[c].thread_elements()[1] *= alpha;
        for (int t = 0; t < NT; ++t) {
          simdgroup_float8x8 vf;
          // Keys past kend read as zero: V past the valid length may hold anything.
          sdpa_load_kv(vf, vb, voff[t], c * 8, lane);
          sdpa_mma_select(acc[c], s[t], vf, lane);  // a hidden key's NaN value stays out
        }
      }
    }
  }

  // Rows past the valid length, and rows with nothing to attend to, give 0 and lse -inf.
  const bool live = i < qlen && sdpa_row_live(l_run);
  const float inv = live ? 1.0f / l_run : 0.0f;
  device T* ob = out + b * p.o_stride[0] + h * p.o_stride[1];
  for (int c = 0; c < NC; ++c)
    if (c < ndv) sdpa_store(acc[c], ob, p.o_stride[2], row0, p.len_q, c * 8, inv, lane);
  if (fc == 0 && i < p.len_q)
    lse[(long(b) * p.heads_q + h) * p.len_q + i] =
        live ? (m_run + log2(l_run)) * SDPA_LN2 : SDPA_NEG_INF;
}

// Kernel names: sdpa_fwd_<dtype>_<dmax>, with soft-capping sdpa_fwd_<dtype>_<dmax>_cap.
#define SDPA_FWD_INST(tn, T, D)                                             \
  MSL_INSTANTIATE_KERNEL("sdpa_fwd_" #tn "_" #D, sdpa_fwd, T, D, false)  \
  MSL_INSTANTIATE_KERNEL("sdpa_fwd_" #tn "_" #D "_cap", sdpa_fwd, T, D, true)
#define SDPA_FWD_INST_ALL(tn, T) \
  SDPA_FWD_INST(tn, T, 64) SDPA_FWD_INST(tn, T, 128) SDPA_FWD_INST(tn, T, 256) SDPA_FWD_INST(tn, T, 512)
SDPA_FWD_INST_ALL(f32, float)
SDPA_FWD_INST_ALL(f16, half)
SDPA_FWD_INST_ALL(bf16, bfloat)
