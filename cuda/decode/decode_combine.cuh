// combine_kernel: the split-K merge of the decode kernels' partial outputs.
#pragma once

#include "cuda/decode/decode_common.cuh"

namespace jax_sdpa {
namespace cuda_decode {

// ---- split-K combine ---------------------------------------------------------------
// Separate combine (launched after the main kernel when the fused merge would be
// long for one block: many splits x wide rows, e.g. D512 at small batch).
// kCombineLanes adjacent threads share one (output row, 4 dv) item, each merging
// every kCombineLanes-th split, then reduce with shuffles: at 33 splits a thread
// has 9 partials to load instead of 33, all independent, so the grid streams the
// partials in a couple of L2 round trips.
constexpr int kCombineLanes = 4;

template <typename T, int DV>
__global__ void __launch_bounds__(128, 4) combine_kernel(const Args a) {
  constexpr int DV4 = DV / 4;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int part = static_cast<int>(tid % kCombineLanes);
  const int64_t item = tid / kCombineLanes;
  // Threads past the last item stay for the warp-wide shuffles below and merge
  // nothing (item clamped to a valid one, nsplit loop skipped, no write).
  const bool active = item < a.rows * DV4;
  const int64_t item_c = active ? item : 0;
  const int grow32 = static_cast<int>(item_c / DV4);  // rows < 2^31 (checked on the host)
  const int c = static_cast<int>(item_c - static_cast<int64_t>(grow32) * DV4);
  const int64_t grow = grow32;
  const int i = grow32 % a.Lq;
  const int h = (grow32 / a.Lq) % a.Hq;
  const int b = grow32 / (a.Lq * a.Hq);
  const int qlen = static_cast<int>(clamp_length(a.qlen, b, a.Lq));
  const float* lse = a.part_lse + grow;
  // The row max, also split over the item's lanes: one serial pass over every split's
  // lse was most of this kernel (4.5 us at 33 splits, B1 KV4 D512).
  float M = -INFINITY;
  if (active) {
#pragma unroll 4
    for (int sp = part; sp < a.nsplit; sp += kCombineLanes) M = fmaxf(M, lse[sp * a.rows]);
  }
#pragma unroll
  for (int off = 1; off < kCombineLanes; off <<= 1)
    M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  float L = 0.f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  {  // also when M = -inf: a NaN split lse (max skips it) must make L NaN
    const float* src = a.part_o + grow * DV + 4 * c;
    const int64_t sstride = a.rows * DV;
#pragma unroll 4
    for (int sp = part; sp < a.nsplit; sp += kCombineLanes) {
      const float ls = lse[sp * a.rows];
      const float4 x = *reinterpret_cast<const float4*>(src + sp * sstride);
      const float wgt = ls == -INFINITY ? 0.f : exp2f(ls - M);
      L += wgt;
      o.x = fmaf(wgt, x.x, o.x);
      o.y = fmaf(wgt, x.y, o.y);
      o.z = fmaf(wgt, x.z, o.z);
      o.w = fmaf(wgt, x.w, o.w);
    }
  }
#pragma unroll
  for (int off = 1; off < kCombineLanes; off <<= 1) {
    L += __shfl_xor_sync(0xffffffffu, L, off);
    o.x += __shfl_xor_sync(0xffffffffu, o.x, off);
    o.y += __shfl_xor_sync(0xffffffffu, o.y, off);
    o.z += __shfl_xor_sync(0xffffffffu, o.z, off);
    o.w += __shfl_xor_sync(0xffffffffu, o.w, off);
  }
  if (!active || part != 0) return;
  float scale, lse_out;
  row_normalizer(a, b, h, i, qlen, M, L, &scale, &lse_out);
  if (c == 0) a.lse[grow] = lse_out;
  store4<T>(reinterpret_cast<T*>(a.out) + out_offset(a, b, h, i) + 4 * c, scaled_row(o, scale));
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
