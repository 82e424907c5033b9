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
// decode_wide_tma.cuh): every warp holds the same summed scores of a tile, so the same
// online softmax, and writes its own output columns at the end.

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
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mn = fmaxf(m_run, mx);
  const float mu = mn == -INFINITY ? 0.f : mn;
  const float al = exp2f(m_run - mu);
  m_run = mn;
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

// The end of one output row of a wide kernel (block row rr, its log2-domain max M and
// sum L): with one split, put(out row, scale) writes the thread's outputs times the
// row's normalizer, and the lse; with several, put(partial row, 1 / L) writes normalized
// partials for combine_kernel, and the split's lse. stats_writer: this thread writes the
// lse (every warp holds the same stats). Rows past the group are skipped.
template <typename T, int DV, typename Put>
__device__ __forceinline__ void wide_finish_row(const Args& a, int b, int kvh, int r0, int rr,
                                                int split, int qlen, float M, float L,
                                                bool stats_writer, Put put) {
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
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int rr = 2 * t + q;
    const float M = __shfl_sync(0xffffffffu, m_run, rr * 4);
    const float L = __shfl_sync(0xffffffffu, l_run, rr * 4);
    wide_finish_row<T, DV>(a, b, kvh, r0, rr, split, qlen, M, L, stats_warp && g == 0,
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
  constexpr int EPV = 16 / sizeof(T);
  constexpr int NTHR = Cfg::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);                                     // [RB][DP]
  float* Sx = reinterpret_cast<float*>(smem + Cfg::kQBytes);              // [NW][32][4]
  T* ring = reinterpret_cast<T*>(smem + Cfg::kQBytes + Cfg::kScoreBytes);  // [S][stage]

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const BlockWork wk = block_work(a, RB);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  const int kvlen = wk.kvlen;
  int ks0, ks1;
  split_range(a, r0, RB, split, qlen, kvlen, &ks0, &ks1);
  const int ntiles = (ks1 - ks0 + kTileKeys - 1) / kTileKeys;
  const T* kbase = reinterpret_cast<const T*>(a.k) + b * a.ks[0] + kvh * a.ks[1];
  const T* vbase = reinterpret_cast<const T*>(a.v) + b * a.vs[0] + kvh * a.vs[1];
  auto load = [&](int tile) {
    T* st = ring + (tile % S) * STAGE;
    const int j0 = ks0 + tile * kTileKeys;
    load_rows_by<T, D / EPV, DP, PF, NTHR>(st, kbase, a.ks[2], j0, ks1, tid);
    load_rows_by<T, DV / EPV, DVP, PF, NTHR>(st + kTileKeys * DP, vbase, a.vs[2], j0, ks1,
                                                 tid);
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
#pragma unroll
  for (int c = 0; c < NVC; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[c][j][e] = 0.f;

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
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = s_odd[n][e] = 0.f;
#pragma unroll
    for (int c = 0; c < NKC; ++c) {
      float(&sc)[2][4] = (c & 1) ? s_odd : s;
      const int d = w * Cfg::DQ + 32 * c + 8 * t;
      const uint4 qa = *reinterpret_cast<const uint4*>(Qs + g * DP + d);
      const uint4 k0 = *reinterpret_cast<const uint4*>(Ks + g * DP + d);
      const uint4 k1 = *reinterpret_cast<const uint4*>(Ks + (g + 8) * DP + d);
      mma16816<T>(sc[0], qa.x, 0u, qa.y, 0u, k0.x, k0.y);
      mma16816<T>(sc[1], qa.x, 0u, qa.y, 0u, k1.x, k1.y);
      mma16816<T>(sc[0], qa.z, 0u, qa.w, 0u, k0.z, k0.w);
      mma16816<T>(sc[1], qa.z, 0u, qa.w, 0u, k1.z, k1.w);
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
    float4 tot = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) {
      const float4 x = *reinterpret_cast<const float4*>(Sx + (ww * 32 + lane) * 4);
      tot.x += x.x;
      tot.y += x.y;
      tot.z += x.z;
      tot.w += x.w;
    }

    // 2. Online softmax of row g (identical in every warp).
    const int j0 = ks0 + it * kTileKeys;
    float p[4] = {tot.x, tot.y, tot.z, tot.w};
    uint32_t pb[2];
    wide_softmax<T>(a, row, p, [&](int e) { return j0 + 8 * (e >> 1) + 2 * t + (e & 1); },
                    m_run, l_run, acc, pb);
    const uint32_t pb0 = pb[0], pb1 = pb[1];

    // 3. O^T += V^T P^T over output columns [w * DVW, (w + 1) * DVW).
#pragma unroll
    for (int c = 0; c < NVC; ++c) {
      const int dv = w * Cfg::DVW + 64 * c + 8 * g;
      const uint4 v0 = *reinterpret_cast<const uint4*>(Vs + (2 * t) * DVP + dv);
      const uint4 v1 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 1) * DVP + dv);
      const uint4 v2 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 8) * DVP + dv);
      const uint4 v3 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 9) * DVP + dv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t x0 = u4get(v0, j), x1 = u4get(v1, j), x2 = u4get(v2, j),
                       x3 = u4get(v3, j);
        mma16816<T>(acc[c][j], prmt(x0, x1, 0x5410), prmt(x0, x1, 0x7632), prmt(x2, x3, 0x5410),
                    prmt(x2, x3, 0x7632), pb0, pb1);
      }
    }
  }
  cp_async_wait<0>();

  wide_store<T, DV>(a, acc, m_run, l_run, b, kvh, r0, split, qlen, w == 0,
                    [&](int c, int j) { return w * Cfg::DVW + 64 * c + 8 * g + 2 * j; });
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
