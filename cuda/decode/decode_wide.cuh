// Wide-head decode kernel (bf16 / fp16, D = Dv in {256, 512}, up to 8 query rows a
// block): the block's NW warps split the head dims instead of the keys.
//
// Why: with one 16-key tile per warp (decode_tc_kernel) a D512 stage is 34 KB a warp,
// so four warps fit one stage each (no copy in flight while they compute) and every
// tile's load latency is exposed. Here the whole block streams one 16-key tile at a
// time through an S-deep ring shared by all warps (S - 1 tiles in flight, 34 KB each),
// and for each tile
//   1. warp w computes the partial scores of its D / NW head dims (mma m16n8k16),
//   2. the partials meet in shared memory (8 floats a lane) and every warp sums them,
//      so all warps hold the same scores and run the same online softmax,
//   3. warp w accumulates O^T += V^T P^T for its Dv / NW output columns.
// Two block barriers a tile. No cross-warp merge at the end: each warp writes its
// own output columns (one split) or normalized partials for combine_kernel.
// Fragment layouts are decode_tc_kernel's (decode_tc.cuh).
#pragma once

#include <type_traits>

#include "cuda/decode/decode_common.cuh"

namespace jax_sdpa {
namespace cuda_decode {

template <typename T, int D, int DV, int NW, int S>
struct WideConfig {
  static_assert(S >= 2, "wide decode: the ring needs a tile in flight");
  static constexpr int kThreads = NW * 32;
  static constexpr int kRows = 8;      // query rows a block (A rows 8..15 are zero)
  static constexpr int DQ = D / NW;    // head dims of a warp's QK share
  static constexpr int DVW = DV / NW;  // output columns of a warp's PV share
  static_assert(DQ % 32 == 0 && DVW % 64 == 0, "wide decode: D / NW % 32, Dv / NW % 64");
  // decode_tc_kernel's pads (bank conflicts of the fragment loads).
  static constexpr int DP = D + ((64 - (D * 2) % 128) + 128) % 128 / 2;
  static constexpr int DVP = DV + 8;
  static constexpr int kStage = kTileKeys * (DP + DVP);
  static constexpr size_t kQBytes = kRows * DP * sizeof(T);
  static constexpr size_t kScoreBytes = NW * 32 * 4 * sizeof(float);
  static constexpr size_t kRingBytes = static_cast<size_t>(S) * kStage * sizeof(T);
  static constexpr size_t kSmem = kQBytes + kScoreBytes + kRingBytes;
};

// The wide kernels' shared pieces (decode_wide_kernel here, decode_wide_tma_kernel in
// decode_wide_tma.cuh; decode_wide_f32_kernel takes the score sum and the row ends):
// every warp holds the same summed scores of a tile, so the same online softmax, and
// writes its own output columns at the end.

// Every warp's partial scores of this lane summed (the wide kernels' exchange): p[4k + e]
// = sum over warps ww of element e of sx[(ww K + k) 32 + lane], K tiles a warp.
template <int NW, int K>
__device__ __forceinline__ void sum_warp_scores(const float4* sx, int lane, float (&p)[4 * K]) {
#pragma unroll
  for (int e = 0; e < 4 * K; ++e) p[e] = 0.f;
#pragma unroll
  for (int ww = 0; ww < NW; ++ww)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float4 x = sx[(ww * K + k) * 32 + lane];
      p[4 * k] += x.x;
      p[4 * k + 1] += x.y;
      p[4 * k + 2] += x.z;
      p[4 * k + 3] += x.w;
    }
}

// One step's online softmax of row g: p = this thread's NP summed scores (raw, in
// groups of four per 16-key tile: mma key indices 2t, 2t+1, 2t+8, 2t+9), of keys
// key_of(e). Updates the row's max / partial sum, rescales the output accumulators
// (O^T: columns = query rows 2t, 2t+1) and returns P^T's B fragments (two a tile).
template <typename T, int NP, int NVC, typename KeyOf>
__device__ __forceinline__ void wide_softmax(const Args& a, const RowInfo& row, float (&p)[NP],
                                             KeyOf key_of, float& m_run, float& l_run,
                                             float (&acc)[NVC][4][4], uint32_t (&pb)[NP / 2]) {
  const int t = threadIdx.x & 3;
  float mx = -INFINITY;
#pragma unroll
  for (int e = 0; e < NP; ++e) {
    p[e] = masked_score(a, p[e] * a.scale_log2, key_of(e), row.first, row.last, row.mrow);
    mx = fmaxf(mx, p[e]);
  }
  float mu;
  const float al = online_rescale<SoftmaxExp::kExp2>(m_run, fmaxf(m_run, quad_max(mx)), mu);
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < NP; ++e) {
    p[e] = exp2f(p[e] - mu);
    sum += p[e];
  }
  l_run = l_run * al + sum;  // per-thread partial; quad-reduced at the end
  if (__any_sync(0xffffffffu, al != 1.f)) {
    const float a0 = __shfl_sync(0xffffffffu, al, (2 * t) * 4);
    const float a1 = __shfl_sync(0xffffffffu, al, (2 * t + 1) * 4);
#pragma unroll
    for (int c = 0; c < NVC; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[c][j][0] *= a0;
        acc[c][j][1] *= a1;
        acc[c][j][2] *= a0;
        acc[c][j][3] *= a1;
      }
  }
#pragma unroll
  for (int e = 0; e < NP / 2; ++e) pb[e] = pack2<T>(p[2 * e], p[2 * e + 1]);
}

// The end of one output row of a wide kernel (block row rr): its log2-domain max M and
// sum L are lane 4 rr's m_run / l_run (each lane holds row lane / 4's, quad-reduced; every
// lane calls this, shuffles first). With one split, put(out row, scale) writes the
// thread's outputs times the row's normalizer, and the lse; with several, put(partial
// row, 1 / L) writes normalized partials for combine_kernel, and the split's lse.
// stats_writer: this thread writes the lse (every warp holds the same stats). Rows past
// the group are skipped.
template <typename T, int DV, typename Put>
__device__ __forceinline__ void wide_finish_row(const Args& a, int b, int kvh, int r0, int rr,
                                                int split, int qlen, float m_run, float l_run,
                                                bool stats_writer, Put put) {
  const float M = __shfl_sync(0xffffffffu, m_run, rr * 4);
  const float L = __shfl_sync(0xffffffffu, l_run, rr * 4);
  const int r = r0 + rr;
  if (r >= a.R) return;
  const HeadQuery hq = head_query(a, kvh, r);
  const int h = hq.h, i = hq.i;
  const int64_t grow = (static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i;
  if (a.nsplit == 1) {
    float scale, lse;
    row_normalizer(a, b, h, i, qlen, M, L, &scale, &lse);
    if (stats_writer) a.lse[grow] = lse;
    put(reinterpret_cast<T*>(a.out) + out_offset(a, b, h, i), scale);
  } else {
    const int64_t pr = static_cast<int64_t>(split) * a.rows + grow;
    const bool empty = cuda_common::softmax_row_empty(L);  // a NaN L is not
    const float scale = empty ? 0.f : __fdividef(1.f, L);
    if (stats_writer) a.part_lse[pr] = empty ? -INFINITY : M + log2f(L);
    put(a.part_o + pr * DV, scale);
  }
}

// The end of a 16-bit wide kernel's warp: row g's sum over the quad, then this thread's
// two output rows (query rows 2t and 2t + 1 of the block: O^T's columns), its output
// columns dv_of(c, j) (acc[c][j]: dv, dv + 1). stats_warp: this warp writes the lse.
template <typename T, int DV, int NVC, typename DvOf>
__device__ __forceinline__ void wide_store(const Args& a, const float (&acc)[NVC][4][4],
                                           float m_run, float l_run, int b, int kvh, int r0,
                                           int split, int qlen, bool stats_warp, DvOf dv_of) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  l_run = quad_sum(l_run);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int rr = 2 * t + q;
    wide_finish_row<T, DV>(a, b, kvh, r0, rr, split, qlen, m_run, l_run, stats_warp && g == 0,
                           [&](auto* dst, float scale) {
#pragma unroll
                             for (int c = 0; c < NVC; ++c)
#pragma unroll
                               for (int j = 0; j < 4; ++j) {
                                 // scale 0: 0 selected (a NaN through P = 0 stays out)
                                 const float x0 = scale == 0.f ? 0.f : acc[c][j][q] * scale;
                                 const float x1 = scale == 0.f ? 0.f : acc[c][j][q + 2] * scale;
                                 if constexpr (std::is_same_v<decltype(dst), float*>)
                                   *reinterpret_cast<float2*>(dst + dv_of(c, j)) =
                                       make_float2(x0, x1);
                                 else
                                   *reinterpret_cast<uint32_t*>(dst + dv_of(c, j)) =
                                       pack2<T>(x0, x1);
                               }
                           });
  }
}

template <typename T, int D, int DV, int NW, int S, int PF>
__global__ void __launch_bounds__(NW * 32, 1) decode_wide_kernel(const Args a) {
  using Cfg = WideConfig<T, D, DV, NW, S>;
  constexpr int DP = Cfg::DP, DVP = Cfg::DVP, STAGE = Cfg::kStage, RB = Cfg::kRows;
  constexpr int NKC = Cfg::DQ / 32;   // this warp's 32-wide head-dim chunks (QK)
  constexpr int NVC = Cfg::DVW / 64;  // this warp's 64-wide dv chunks (PV)
  constexpr int NTHR = Cfg::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);                                     // [RB][DP]
  float* Sx = reinterpret_cast<float*>(smem + Cfg::kQBytes);              // [NW][32][4]
  T* ring = reinterpret_cast<T*>(smem + Cfg::kQBytes + Cfg::kScoreBytes);  // [S][stage]

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  int ks0, ks1;
  const BlockWork wk = block_keys(a, RB, &ks0, &ks1);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  const int kvlen = wk.kvlen;
  const int ntiles = key_steps(ks0, ks1);
  const T* kbase = kv_head_base<T>(a.k, a.ks, b, kvh);
  const T* vbase = kv_head_base<T>(a.v, a.vs, b, kvh);
  auto load = [&](int tile) {
    load_tile_by<T, D, DV, DP, DVP, PF, NTHR>(ring + (tile % S) * STAGE, kbase, vbase, a.ks[2],
                                              a.vs[2], ks0 + tile * kTileKeys, ks1, tid);
  };
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < ntiles) load(st);
    cp_async_commit();
  }

  // Q rows of the block -> smem (zeros past the group); read after the loop's barrier.
  load_q_rows<T, D, DP, RB, RB, NTHR>(Qs, a, b, kvh, r0, tid);

  const RowInfo row = row_info(a, b, kvh, r0 + g, qlen, kvlen);
  float m_run = -INFINITY, l_run = 0.f;
  float acc[NVC][4][4];
  fill_zero(acc);

  for (int it = 0; it < ntiles; ++it) {
    // Committed groups: S - 1 + it; tile it is group it -> at most S - 2 pending.
    cp_async_wait<S - 2>();
    // (1) every thread's copies of tile it are visible; every warp is done with
    // iteration it - 1 (its stage and the score exchange).
    __syncthreads();
    const T* Ks = ring + (it % S) * STAGE;
    const T* Vs = Ks + kTileKeys * DP;

    // 1. Partial S = Q K^T over head dims [w * DQ, (w + 1) * DQ).
    float s[2][4], s_odd[2][4];
    fill_zero(s);
    fill_zero(s_odd);
#pragma unroll
    for (int c = 0; c < NKC; ++c) {
      const int d = w * Cfg::DQ + 32 * c + 8 * t;
      const uint4 qa = *reinterpret_cast<const uint4*>(Qs + g * DP + d);
      const uint4 k0 = *reinterpret_cast<const uint4*>(Ks + g * DP + d);
      const uint4 k1 = *reinterpret_cast<const uint4*>(Ks + (g + 8) * DP + d);
      mma_qk_step<T>((c & 1) ? s_odd : s, qa, make_uint4(0, 0, 0, 0), k0, k1);
    }
    // Row g's four scores of this thread (keys 2t, 2t+1, 2t+8, 2t+9 of the tile).
    *reinterpret_cast<float4*>(Sx + (w * 32 + lane) * 4) =
        make_float4(s[0][0] + s_odd[0][0], s[0][1] + s_odd[0][1], s[1][0] + s_odd[1][0],
                    s[1][1] + s_odd[1][1]);
    // Refill the stage every warp finished in iteration it - 1 (barrier (1)).
    {
      const int nx = it + S - 1;
      if (nx < ntiles) load(nx);
      cp_async_commit();
    }
    __syncthreads();  // (2) the partial scores are visible
    float p[4];
    sum_warp_scores<NW, 1>(reinterpret_cast<const float4*>(Sx), lane, p);

    // 2. Online softmax of row g (identical in every warp).
    const int j0 = ks0 + it * kTileKeys;
    uint32_t pb[2];
    wide_softmax<T>(a, row, p, [&](int e) { return j0 + 8 * (e >> 1) + 2 * t + (e & 1); },
                    m_run, l_run, acc, pb);
    const uint32_t pb0 = pb[0], pb1 = pb[1];

    // 3. O^T += V^T P^T over output columns [w * DVW, (w + 1) * DVW).
#pragma unroll
    for (int c = 0; c < NVC; ++c) {
      uint4 v0, v1, v2, v3;
      load_vt_rows<DVP>(Vs, t, w * Cfg::DVW + 64 * c + 8 * g, v0, v1, v2, v3);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t A[4];
        vt_fragment(v0, v1, v2, v3, j, A);
        mma16816<T>(acc[c][j], A[0], A[1], A[2], A[3], pb0, pb1);
      }
    }
  }
  cp_async_wait<0>();

  wide_store<T, DV>(a, acc, m_run, l_run, b, kvh, r0, split, qlen, w == 0,
                    [&](int c, int j) { return w * Cfg::DVW + 64 * c + 8 * g + 2 * j; });
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
