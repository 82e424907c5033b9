// decode_simt_kernel: fp32 decode on the CUDA cores, in full fp32.
#pragma once

#include "cuda/decode/decode_common.cuh"

namespace jax_sdpa {
namespace cuda_decode {

// ---- fp32: CUDA cores ------------------------------------------------------------
//
// Per warp and 16-key tile: lane (key kk = lane & 15, half = lane >> 4) dots its
// key with the 8 query rows over alternating 16-byte head-dim chunks (Q is a
// broadcast smem read), the halves are summed with one shuffle; softmax per row
// over the 16 lanes; p goes to smem and PV runs with lanes over dv.
template <int D, int DV, int W, int S>
struct SimtConfig {
  static constexpr int kThreads = W * 32;
  static constexpr int RB = 8;
  static constexpr int DP = D + 4, DVP = DV + 4;
  static constexpr int kStage = kTileKeys * (DP + DVP);
  static constexpr size_t kQBytes = RB * D * sizeof(float);
  static constexpr size_t kPBytes = W * RB * kTileKeys * sizeof(float);
  static constexpr size_t kRowBytes = RB * (2 * sizeof(int) + sizeof(int64_t));
  static constexpr size_t kRingBytes = static_cast<size_t>(W) * S * kStage * sizeof(float);
  static constexpr size_t kHead = kQBytes + kPBytes + kRowBytes;
  static constexpr size_t kRedBytes = static_cast<size_t>(W) * 16 * (2 + DV) * sizeof(float);
  static constexpr size_t kSmem =
      (kHead + kRingBytes) > kRedBytes ? (kHead + kRingBytes) : kRedBytes;
};

template <int D, int DV, int W, int S, int PF>
__global__ void __launch_bounds__(W * 32, 1) decode_simt_kernel(const Args a) {
  using Cfg = SimtConfig<D, DV, W, S>;
  constexpr int RB = Cfg::RB, DP = Cfg::DP, DVP = Cfg::DVP, STAGE = Cfg::kStage;
  constexpr int NQV = D / 4;               // float4 chunks of a K row
  constexpr int NVV = DV / 4;              // float4 chunks of a V row
  constexpr int VX = (NVV + 31) / 32;      // float4 chunks of dv per lane
  extern __shared__ __align__(16) unsigned char smem[];
  float* Qs = reinterpret_cast<float*>(smem);                     // [RB][D]
  float* Ps = reinterpret_cast<float*>(smem + Cfg::kQBytes);      // [W][RB][16]
  int64_t* rmrow = reinterpret_cast<int64_t*>(smem + Cfg::kQBytes + Cfg::kPBytes);
  int* rfirst = reinterpret_cast<int*>(rmrow + RB);
  int* rlast = rfirst + RB;
  float* ring = reinterpret_cast<float*>(smem + Cfg::kHead);

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int kk = lane & 15, half = lane >> 4;
  const BlockWork wk = block_work(a, RB);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  const int kvlen = wk.kvlen;
  int ks0, ks1;
  split_range(a, r0, RB, split, qlen, kvlen, &ks0, &ks1);
  const int ntiles = key_steps(ks0, ks1);
  const int my_tiles = ntiles > w ? (ntiles - w + W - 1) / W : 0;
  const float* kbase = kv_head_base<float>(a.k, a.ks, b, kvh);
  const float* vbase = kv_head_base<float>(a.v, a.vs, b, kvh);
  float* myring = ring + w * S * STAGE;
  float* myP = Ps + w * RB * kTileKeys;

#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < my_tiles)
      load_tile<float, D, DV, DP, DVP, PF>(myring + st * STAGE, kbase, vbase, a.ks[2], a.vs[2],
                                       ks0 + (w + st * W) * kTileKeys, ks1, lane);
    cp_async_commit();
  }

  for (int idx = tid; idx < RB * NQV; idx += Cfg::kThreads) {
    const int rr = idx / NQV, c = idx - rr * NQV;
    const int r = r0 + rr;
    float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < a.R) {
      const HeadQuery hq = head_query(a, kvh, r);
      const int h = hq.h, i = hq.i;
      val = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(a.q) + b * a.qs[0] +
                                             h * a.qs[1] + i * a.qs[2] + 4 * c);
    }
    *reinterpret_cast<float4*>(Qs + rr * D + 4 * c) = val;
  }
  if (tid < RB) {
    RowInfo ri = row_info(a, b, kvh, r0 + tid, qlen, kvlen);
    rmrow[tid] = ri.mrow;
    rfirst[tid] = ri.first;
    rlast[tid] = ri.last;
  }
  __syncthreads();

  float m[RB], l[RB], acc[RB][VX][4];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  fill_zero(acc);

  for (int it = 0; it < my_tiles; ++it) {
    {
      const int nx = it + S - 1;
      if (nx < my_tiles)
        load_tile<float, D, DV, DP, DVP, PF>(myring + (nx % S) * STAGE, kbase, vbase, a.ks[2],
                                         a.vs[2], ks0 + (w + nx * W) * kTileKeys, ks1, lane);
      cp_async_commit();
    }
    cp_async_wait<S - 1>();
    __syncwarp();
    const float* Ks = myring + (it % S) * STAGE;
    const float* Vs = Ks + kTileKeys * DP;
    const int j = ks0 + (w + it * W) * kTileKeys + kk;

    float s[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) s[r] = 0.f;
#pragma unroll 4
    for (int c = half; c < NQV; c += 2) {
      const float4 kv = *reinterpret_cast<const float4*>(Ks + kk * DP + 4 * c);
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const float4 qv = *reinterpret_cast<const float4*>(Qs + r * D + 4 * c);
        s[r] = fmaf(qv.x, kv.x, s[r]);
        s[r] = fmaf(qv.y, kv.y, s[r]);
        s[r] = fmaf(qv.z, kv.z, s[r]);
        s[r] = fmaf(qv.w, kv.w, s[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      s[r] += __shfl_xor_sync(0xffffffffu, s[r], 16);
      s[r] = masked_score(a, s[r] * a.scale_log2, j, rfirst[r], rlast[r], rmrow[r]);
      float mx = s[r];
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float mn = fmaxf(m[r], mx);
      const float mu = mn == -INFINITY ? 0.f : mn;
      const float al = exp2f(m[r] - mu);
      m[r] = mn;
      const float p = exp2f(s[r] - mu);
      l[r] = l[r] * al + (half == 0 ? p : 0.f);
      if (half == 0) myP[r * kTileKeys + kk] = p;
#pragma unroll
      for (int x = 0; x < VX; ++x)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][x][e] *= al;
    }
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < kTileKeys; jj += 4) {
      float4 pr[RB];
#pragma unroll
      for (int r = 0; r < RB; ++r) pr[r] = *reinterpret_cast<const float4*>(myP + r * kTileKeys + jj);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int x = 0; x < VX; ++x) {
          const int c = lane + 32 * x;
          if (NVV % 32 == 0 || c < NVV) {
            const float4 vv = *reinterpret_cast<const float4*>(Vs + (jj + q) * DVP + 4 * c);
#pragma unroll
            for (int r = 0; r < RB; ++r) {
              const float pq = q == 0 ? pr[r].x : (q == 1 ? pr[r].y : (q == 2 ? pr[r].z : pr[r].w));
              acc[r][x][0] = fmaf(pq, vv.x, acc[r][x][0]);
              acc[r][x][1] = fmaf(pq, vv.y, acc[r][x][1]);
              acc[r][x][2] = fmaf(pq, vv.z, acc[r][x][2]);
              acc[r][x][3] = fmaf(pq, vv.w, acc[r][x][3]);
            }
          }
        }
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 16);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 8);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 4);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
  }
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);
  float* red_m = red;
  float* red_l = red + W * 16;
  float* red_o = red + 2 * W * 16;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      red_m[w * 16 + r] = m[r];
      red_l[w * 16 + r] = l[r];
    }
  }
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int x = 0; x < VX; ++x) {
      const int c = lane + 32 * x;
      if (NVV % 32 == 0 || c < NVV)
        *reinterpret_cast<float4*>(red_o + (w * 16 + r) * DV + 4 * c) =
            make_float4(acc[r][x][0], acc[r][x][1], acc[r][x][2], acc[r][x][3]);
    }
  __syncthreads();
  block_finish<float, DV, W>(a, red, RB, b, kvh, r0, split, qlen);
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
