// Wide-head decode kernel in fp32 (the default for fp32 D = Dv = 512, NW8 S3 or S2:
// make_plan; JAX_SDPA_CUDA_DECODE_WIDE=off runs decode_simt_kernel instead; 8 query rows
// a block): decode_wide_kernel's split of the head dims across warps, with exact fp32
// math on CUDA cores. H200, B1 H32/KV4 Lk8192: 2258-2317 GB/s where decode_simt_kernel
// streamed 1374-1418 (benchmarks/results/h200/decode_tuning/sweep_20261130T1818.json).
//
// Why: decode_simt_kernel gives each of its two warps (D + Dv > 512) whole 16-key tiles
// of 66 KB, one block an SM and no copy in flight, so at D512 two warps an SM do all the
// FMAs: B1 H32/KV4 Lk8192 fp32 streamed at 1.42 TB/s where xla's gemms reach 3.13 on the
// H200. Here the block's NW warps
// share each tile: S - 1 tiles in flight (cp.async, the whole block), and per tile warp w
//   1. computes the partial scores of its D / NW head dims: lane (row g = lane / 4, keys
//      t + 4i) with its row's Q slice in registers, 4 broadcast K loads and 16 FMAs a
//      16-byte chunk,
//   2. exchanges them through shared memory (every warp sums all, so all run the same
//      online softmax; a quad of lanes holds a row's 16 keys),
//   3. accumulates its Dv / NW output columns: lane (dv chunk lane % 16, rows 4 (lane /
//      16) ..+3), P of the tile read back from shared memory.
// Keys past the split are zero-filled by the copies and masked.
#pragma once

#include "cuda/decode/decode_wide.cuh"

namespace jax_sdpa {
namespace cuda_decode {

template <int D, int DV, int NW, int S>
struct WideF32Config {
  static_assert(S >= 2, "wide fp32 decode: the ring needs a tile in flight");
  static constexpr int kThreads = NW * 32;
  static constexpr int kRows = 8;
  static constexpr int DQ = D / NW;    // head dims of a warp's QK share
  static constexpr int DVW = DV / NW;  // output columns of a warp's PV share
  static_assert(DQ % 4 == 0 && DVW == 64, "wide fp32 decode: Dv / NW == 64, D / NW % 4 == 0");
  // Rows padded by 16 bytes: the 4 K rows a QK load touches fall on different banks.
  static constexpr int KP = D + 4, VP = DV + 4;
  static constexpr int kStage = kTileKeys * (KP + VP);  // floats
  static constexpr size_t kRingBytes = static_cast<size_t>(S) * kStage * sizeof(float);
  static constexpr size_t kScoreBytes = NW * 32 * sizeof(float4);  // partial scores
  static constexpr size_t kPBytes = NW * kRows * kTileKeys * sizeof(float);  // P per warp
  static constexpr size_t kSmem = kRingBytes + kScoreBytes + kPBytes;
};

template <int D, int DV, int NW, int S, int PF>
__global__ void __launch_bounds__(NW * 32, 1) decode_wide_f32_kernel(const Args a) {
  using Cfg = WideF32Config<D, DV, NW, S>;
  constexpr int KP = Cfg::KP, VP = Cfg::VP, STAGE = Cfg::kStage, RB = Cfg::kRows;
  constexpr int NQC = Cfg::DQ / 4;  // 16-byte chunks of this warp's head dims
  constexpr int NTHR = Cfg::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  float* ring = reinterpret_cast<float*>(smem);                                  // [S][stage]
  float4* Sx = reinterpret_cast<float4*>(smem + Cfg::kRingBytes);                // [NW][32]
  float* Ps = reinterpret_cast<float*>(smem + Cfg::kRingBytes + Cfg::kScoreBytes);  // [NW][8][16]

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;          // QK / softmax: row g, keys t + 4i
  const int cv = lane & 15, rh = lane >> 4;       // PV: dv chunk cv, rows 4 rh .. 4 rh + 3
  const BlockWork wk = block_work(a, RB);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  const int kvlen = wk.kvlen;
  int ks0, ks1;
  split_range(a, r0, RB, split, qlen, kvlen, &ks0, &ks1);
  // (Not key_steps: here that reorders the S2 kernel's code.)
  const int ntiles = (ks1 - ks0 + kTileKeys - 1) / kTileKeys;
  const float* kbase = kv_head_base<float>(a.k, a.ks, b, kvh);
  const float* vbase = kv_head_base<float>(a.v, a.vs, b, kvh);
  auto load = [&](int tile) {
    load_tile_by<float, D, DV, KP, VP, PF, NTHR>(ring + (tile % S) * STAGE, kbase, vbase,
                                                 a.ks[2], a.vs[2], ks0 + tile * kTileKeys, ks1,
                                                 tid);
  };
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < ntiles) load(st);
    cp_async_commit();
  }

  // Row g's Q slice of this warp's head dims, in registers (zeros past the group).
  float4 q[NQC];
  {
    const int r = r0 + g;
    const float* qrow = nullptr;
    if (r < a.R) {
      const HeadQuery hq = head_query(a, kvh, r);
      const int h = hq.h, i = hq.i;
      qrow = reinterpret_cast<const float*>(a.q) + b * a.qs[0] + h * a.qs[1] + i * a.qs[2] +
             w * Cfg::DQ;
    }
#pragma unroll
    for (int c = 0; c < NQC; ++c)
      q[c] = qrow != nullptr ? *reinterpret_cast<const float4*>(qrow + 4 * c)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const RowInfo row = row_info(a, b, kvh, r0 + g, qlen, kvlen);
  float m_run = -INFINITY, l_run = 0.f;
  float acc[4][4];  // rows 4 rh + r, dv 64 w + 4 cv + e
  fill_zero(acc);
  float* myP = Ps + w * RB * kTileKeys;

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<S - 2>();
    // (1) tile it is visible to every thread; every warp is done with iteration it - 1
    // (its stage, the score exchange).
    __syncthreads();
    const float* Ks = ring + (it % S) * STAGE;
    const float* Vs = Ks + kTileKeys * KP;

    // 1. Partial scores of row g, keys t + 4i, over head dims [w DQ, (w + 1) DQ).
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < NQC; ++c) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 kv =
            *reinterpret_cast<const float4*>(Ks + (t + 4 * i) * KP + w * Cfg::DQ + 4 * c);
        s[i] = fmaf(q[c].x, kv.x, s[i]);
        s[i] = fmaf(q[c].y, kv.y, s[i]);
        s[i] = fmaf(q[c].z, kv.z, s[i]);
        s[i] = fmaf(q[c].w, kv.w, s[i]);
      }
    }
    Sx[w * 32 + lane] = make_float4(s[0], s[1], s[2], s[3]);
    {
      const int nx = it + S - 1;  // the stage every warp finished in iteration it - 1
      if (nx < ntiles) load(nx);
      cp_async_commit();
    }
    __syncthreads();  // (2) the partial scores are visible
    float p[4];
    sum_warp_scores<NW, 1>(Sx, lane, p);

    // 2. Online softmax of row g (identical in every warp).
    const int j0 = ks0 + it * kTileKeys;
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = j0 + t + 4 * i;
      p[i] = masked_score(a, p[i] * a.scale_log2, j < ks1 ? j : INT_MAX, row.first, row.last,
                          row.mrow);
      mx = fmaxf(mx, p[i]);
    }
    float mu;
    const float al = online_rescale<SoftmaxExp::kExp2>(m_run, fmaxf(m_run, quad_max(mx)), mu);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p[i] = exp2f(p[i] - mu);
      sum += p[i];
      myP[g * kTileKeys + t + 4 * i] = p[i];
    }
    l_run = l_run * al + sum;  // per-thread partial; quad-reduced at the end
    if (__any_sync(0xffffffffu, al != 1.f)) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float ar = __shfl_sync(0xffffffffu, al, (4 * rh + r) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][e] *= ar;
      }
    }
    __syncwarp();  // this warp's P of the tile is visible to its lanes

    // 3. O += P V over output columns 64 w + 4 cv .. + 3, rows 4 rh .. + 3.
#pragma unroll
    for (int jj = 0; jj < kTileKeys; jj += 4) {
      float4 pr[4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
        pr[r] = *reinterpret_cast<const float4*>(myP + (4 * rh + r) * kTileKeys + jj);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float4 vv =
            *reinterpret_cast<const float4*>(Vs + (jj + k) * VP + w * Cfg::DVW + 4 * cv);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float pk = k == 0 ? pr[r].x : (k == 1 ? pr[r].y : (k == 2 ? pr[r].z : pr[r].w));
          acc[r][0] = fmaf(pk, vv.x, acc[r][0]);
          acc[r][1] = fmaf(pk, vv.y, acc[r][1]);
          acc[r][2] = fmaf(pk, vv.z, acc[r][2]);
          acc[r][3] = fmaf(pk, vv.w, acc[r][3]);
        }
      }
    }
    __syncwarp();  // P is rewritten next tile
  }
  cp_async_wait<0>();

  // Row g's sum over its quad; then rows 4 rh + r take their stats from lane 4 (4 rh + r).
  l_run = quad_sum(l_run);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int rr = 4 * rh + r;
    wide_finish_row<float, DV>(a, b, kvh, r0, rr, split, qlen, m_run, l_run, w == 0 && cv == 0,
                               [&](float* dst, float scale) {
                                 *reinterpret_cast<float4*>(dst + w * Cfg::DVW + 4 * cv) =
                                     scaled_row(make_float4(acc[r][0], acc[r][1],
                                                            acc[r][2], acc[r][3]),
                                                scale);
                               });
  }
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
