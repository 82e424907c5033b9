// The split-K merge inside the main kernel's own grid (GM kernels: decode_tma_kernel,
// decode_wide_tma_kernel), for split counts a thread-block cluster can't hold or whose
// clusters don't all fit the GPU at once.
//
// Why: behind those kernels the partials went to combine_kernel, a second launch whose
// two dependent L2 round trips (every split's lse for the row max, then the partials)
// and its own start cost 2.5-3 us a call on the H200 (D512 B1 Lk8192: 3.2 of ~30 us, B1
// Lk32768 D128: 2.5 of ~41).
//
// How: the kernel runs as a cooperative launch (every block resident at once: the plan
// checks the occupancy, the launch fails rather than deadlocks if it does not hold).
// Each block writes its normalized partial out and lse to the workspace as before
// (block_finish / wide_store), all blocks meet at one grid barrier
// (cooperative_groups' grid sync, whose barrier word the driver keeps per launch), then
// block k of a unit reads every split's lse of the unit's rows (per-split weights in
// shared memory) and merges the k-th share of the 4-wide output columns of those rows
// over all the splits, straight from L2, with many loads in flight a thread: the first
// build gave each (row, columns) item four lanes and loaded one split a lane at a time,
// so at 2 splits (B8 H32/KV8 Lk1024 D512: 64 columns a block) it made 13 dependent L2
// round trips and the call took 54 us where the combine kernel's took ~45.
#pragma once

#include <cooperative_groups.h>

#include "cuda/decode_attention.cuh"

namespace jax_sdpa {
namespace cuda_decode {

// Per thread of phase 2: items merged at once and splits a lane loads per item at once
// (every load of a batch in flight together: the partials come from L2).
constexpr int kGridMergeItems = 4;
constexpr int kGridMergeBatch = 4;
// The most splits the plan gives a grid-merge kernel (decode_attention.cu: kMaxSplits).
constexpr int kGridMergeMaxSplits = 256;

// Floats of shared memory grid_merge needs (the caller's ring, free by then).
__host__ __device__ constexpr int grid_merge_smem_floats(int rows, int nsplit) {
  return rows * nsplit + rows;
}

// Every thread of the block calls it (grid barrier), after the block's partial is written.
// `ws`: grid_merge_smem_floats(RB, nsplit) floats of shared memory nothing else uses now.
template <typename T, int DV>
__device__ __forceinline__ void grid_merge(const Args& a, float* ws, int RB, int b, int kvh,
                                           int r0, int split, int qlen) {
  namespace cg = cooperative_groups;
  cg::this_grid().sync();  // every split's partial is in the workspace
  constexpr int DV4 = DV / 4;
  const int n = a.nsplit;
  const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
  const int lane = tid & 31, warp = tid >> 5, nwarps = nthreads >> 5;
  float* wgt = ws;            // [RB][n]: split k's weight in row rr's output (scale folded in)
  float* valid = ws + RB * n;  // [RB]: 1 where the row exists
  auto grow_of = [&](int rr, int* h, int* i) {
    const HeadQuery hq = head_query(a, kvh, r0 + rr);
    *h = hq.h;
    *i = hq.i;
    return (static_cast<int64_t>(b) * a.Hq + hq.h) * a.Lq + hq.i;
  };
  // Phase 1: every split's lse of the block's rows, then per row (a warp each) the max, the
  // sum and the row normalizer (sink, empty rows), folded into per-split weights.
  for (int idx = tid; idx < RB * n; idx += nthreads) {
    const int rr = idx / n, k = idx - rr * n;
    int h, i;
    wgt[idx] = r0 + rr < a.R
                   ? __ldcg(a.part_lse + static_cast<int64_t>(k) * a.rows + grow_of(rr, &h, &i))
                   : -INFINITY;
  }
  __syncthreads();
  for (int rr = warp; rr < RB; rr += nwarps) {
    float* w = wgt + rr * n;
    float M = -INFINITY;
    for (int k = lane; k < n; k += 32) M = fmaxf(M, w[k]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.f;
    for (int k = lane; k < n; k += 32) L += w[k] == -INFINITY ? 0.f : exp2f(w[k] - M);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    float scale = 0.f, lse = -INFINITY;
    const bool row = r0 + rr < a.R;
    int h = 0, i = 0;
    int64_t grow = 0;
    if (row) {
      grow = grow_of(rr, &h, &i);
      row_normalizer(a, b, h, i, qlen, M, L, &scale, &lse);
    }
    __syncwarp();  // every lane read w[] before it is overwritten
    for (int k = lane; k < n; k += 32)
      w[k] = (!row || w[k] == -INFINITY) ? 0.f : exp2f(w[k] - M) * scale;
    if (lane == 0) {
      valid[rr] = row ? 1.f : 0.f;
      if (row && split == 0) a.lse[grow] = lse;  // one block of the unit writes it
    }
  }
  __syncthreads();
  // Phase 2: the block's share of the 4-wide output columns, [c0, c0 + cpb), of every row:
  // lanes a power of two a (row, column) item, as many as the threads allow (at most 8,
  // at most the splits), each summing every L-th split, kGridMergeItems items at once.
  const int cpb = (DV4 + n - 1) / n;
  const int c0 = split * cpb;
  const int items = RB * cpb;
  int L = 1;
  while (L < 8 && L < n && items * (2 * L) <= nthreads) L *= 2;
  const int part = tid % L, group = tid / L, groups = nthreads / L;
  // Uniform trip count over the block: every lane of a warp reaches the shuffles.
  for (int base = 0; base < items; base += groups * kGridMergeItems) {
    float4 o[kGridMergeItems];
    int it_rr[kGridMergeItems], it_c[kGridMergeItems];
    bool live[kGridMergeItems];
    int64_t grow[kGridMergeItems];
#pragma unroll
    for (int u = 0; u < kGridMergeItems; ++u) {
      const int item = base + u * groups + group;
      const int rr = item / cpb;
      it_rr[u] = rr;
      it_c[u] = c0 + (item - rr * cpb);
      live[u] = item < items && rr < RB && it_c[u] < DV4 && valid[rr] != 0.f;
      int h, i;
      grow[u] = live[u] ? grow_of(rr, &h, &i) : 0;
      o[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int k0 = part; k0 < n; k0 += L * kGridMergeBatch) {
      float4 x[kGridMergeItems][kGridMergeBatch];
      float wk[kGridMergeItems][kGridMergeBatch];
#pragma unroll
      for (int u = 0; u < kGridMergeItems; ++u)
#pragma unroll
        for (int v = 0; v < kGridMergeBatch; ++v) {
          const int k = k0 + v * L;
          const bool ok = live[u] && k < n;
          // .cg: from L2 (other blocks wrote these; never cached in this SM's L1).
          x[u][v] = ok ? __ldcg(reinterpret_cast<const float4*>(
                                    a.part_o + (static_cast<int64_t>(k) * a.rows + grow[u]) * DV) +
                                it_c[u])
                       : make_float4(0.f, 0.f, 0.f, 0.f);
          wk[u][v] = ok ? wgt[it_rr[u] * n + k] : 0.f;
        }
#pragma unroll
      for (int u = 0; u < kGridMergeItems; ++u)
#pragma unroll
        for (int v = 0; v < kGridMergeBatch; ++v) {
          o[u].x = fmaf(wk[u][v], x[u][v].x, o[u].x);
          o[u].y = fmaf(wk[u][v], x[u][v].y, o[u].y);
          o[u].z = fmaf(wk[u][v], x[u][v].z, o[u].z);
          o[u].w = fmaf(wk[u][v], x[u][v].w, o[u].w);
        }
    }
#pragma unroll
    for (int u = 0; u < kGridMergeItems; ++u) {
      for (int off = 1; off < L; off <<= 1) {
        o[u].x += __shfl_xor_sync(0xffffffffu, o[u].x, off);
        o[u].y += __shfl_xor_sync(0xffffffffu, o[u].y, off);
        o[u].z += __shfl_xor_sync(0xffffffffu, o[u].z, off);
        o[u].w += __shfl_xor_sync(0xffffffffu, o[u].w, off);
      }
      if (live[u] && part == 0) {
        int h, i;
        grow_of(it_rr[u], &h, &i);
        store4<T>(reinterpret_cast<T*>(a.out) + out_offset(a, b, h, i) + 4 * it_c[u], o[u]);
      }
    }
  }
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
