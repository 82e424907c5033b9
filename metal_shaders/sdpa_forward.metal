// Tiled full-attention forward: out = softmax(scale * q k^T + mask) v and lse, flash style.
// Grid (ceil(Lq / 32), Hq, B), 4 simdgroups; each simdgroup owns 8 query rows and walks its
// visible key blocks (the band of its rows, so causal blocks above the diagonal are skipped)
// with 8x8 simdgroup_matrix tiles and an online softmax in float32 (base 2).
// Simdgroups are independent: no threadgroup memory and no barriers.
#include "sdpa_common.metal"

template <typename T, int DMAX>
[[kernel]] void sdpa_fwd(device const T* q [[buffer(0)]], device const T* k [[buffer(1)]],
                         device const T* v [[buffer(2)]], device const uchar* mask [[buffer(3)]],
                         device const float* sinks [[buffer(4)]],
                         device const int* q_lengths [[buffer(5)]],
                         device const int* kv_lengths [[buffer(6)]], device T* out [[buffer(7)]],
                         device float* lse [[buffer(8)]],
                         constant SdpaMetalParams& p [[buffer(9)]],
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

  device const T* qb = q + b * p.q_stride[0] + h * p.q_stride[1];
  device const T* kb = k + b * p.k_stride[0] + hk * p.k_stride[1];
  device const T* vb = v + b * p.v_stride[0] + hk * p.v_stride[1];

  // Keys the 8 rows can see: band_first/last grow with the row, so the union is
  // [first(row0), last(last valid row)).
  int kbeg = 0, kend = 0;
  if (row0 < qlen) {
    kbeg = sdpa_band_first(row0, off, p.window_left);
    kend = sdpa_band_last(min(row0 + 8, qlen) - 1, off, p.window_right, kvlen);
  }

  // Running max and sum (base 2); a sink starts the row at its logit with mass 1.
  float m_run = SDPA_NEG_INF, l_run = 0.0f;
  if (p.has_sinks != 0) {
    m_run = sinks[b * p.sinks_batch_stride + h] * SDPA_LOG2E;
    l_run = 1.0f;
  }
  simdgroup_float8x8 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int j0 = kbeg; j0 < kend; j0 += SDPA_FWD_BK) {
    simdgroup_float8x8 s[NT];
    for (int t = 0; t < NT; ++t) s[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int c = 0; c < nd; ++c) {
      simdgroup_float8x8 qf;
      sdpa_load(qf, qb, p.q_stride[2], row0, p.len_q, c * 8, lane);
      for (int t = 0; t < NT; ++t) {
        simdgroup_float8x8 kt;
        sdpa_load_t(kt, kb, p.k_stride[2], j0 + t * 8, kend, c * 8, lane);
        simdgroup_multiply_accumulate(s[t], qf, kt, s[t]);
      }
    }
    // Logits, block max, probabilities.
    float mx = SDPA_NEG_INF;
    for (int t = 0; t < NT; ++t) {
      for (int e = 0; e < 2; ++e) {
        const int j = j0 + t * 8 + fc + e;
        const float x = j < kend ? sdpa_logit2(s[t].thread_elements()[e], mask, p, b, h, i, j,
                                               qlen, kvlen, off)
                                 : SDPA_NEG_INF;
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
          // Keys past kend are zero: V past the valid length may hold anything.
          sdpa_load(vf, vb, p.v_stride[2], j0 + t * 8, kend, c * 8, lane);
          simdgroup_multiply_accumulate(acc[c], s[t], vf, acc[c]);
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

#define SDPA_FWD_INST(tn, T, D) MSL_INSTANTIATE_KERNEL("sdpa_fwd_" #tn "_" #D, sdpa_fwd, T, D)
#define SDPA_FWD_INST_ALL(tn, T) \
  SDPA_FWD_INST(tn, T, 64) SDPA_FWD_INST(tn, T, 128) SDPA_FWD_INST(tn, T, 256) SDPA_FWD_INST(tn, T, 512)
SDPA_FWD_INST_ALL(f32, float)
SDPA_FWD_INST_ALL(f16, half)
SDPA_FWD_INST_ALL(bf16, bfloat)
