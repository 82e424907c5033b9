// What every decode (few-query) kernel shares: split-K over keys, GQA rows packed per
// block, cp.async 16-byte loads into a per-warp shared-memory ring, bf16/fp16 on
// tensor cores and fp32 on CUDA cores; the argument struct, row and band helpers, the
// block epilogue and the tile loaders. Host side: decode_attention.cu.
//
// Work decomposition (both kernels):
//   blockIdx.x = ((b * Hk + kv_head) * row_chunks + row_chunk), blockIdx.y = split.
//   A block owns RB query rows r = row_chunk * RB + rr of the kv head's R = G * Lq
//   rows (row r is query head kv_head * G + r / Lq, query index r % Lq), and keys
//   [ks0, ks1): the split's share of the union of its rows' visible key ranges
//   (so a short kv_length reads only the valid prefix of a fixed-size cache).
//   Each of the W warps streams its own 16-key tiles (w, w + W, ...) through an
//   S-deep cp.async ring and keeps an online softmax (log2 domain) per row; the
//   warps are merged in shared memory at the end. With one split the block
//   writes out + lse itself (sinks, empty rows); otherwise it writes a
//   normalized partial out and its lse to scratch and combine_kernel merges.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/device_helpers.cuh"
#include "cuda/common/kernel_args.h"
#include "cuda/common/mma_helpers.cuh"
#include "cuda/common/softmax_rules.cuh"
#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_decode {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kTileKeys = 16;

// Everything a kernel needs, by value (kernel parameter space).
struct Args {
  JAX_SDPA_KERNEL_IO_FIELDS
  float* part_o;    // [splits][rows][Dv] normalized partial outputs
  float* part_lse;  // [splits][rows] log2-domain lse of each split
  int* counters;    // per block unit: splits done (fused combine), self-resetting; or null
  int B, Hq, Hk, Lq, Lk, G, R;  // R = G * Lq rows per kv head
  int RB, row_chunks, nsplit;
  int64_t rows;  // B * Hq * Lq
  JAX_SDPA_KERNEL_STRIDE_FIELDS
  float scale_log2;  // scale * log2(e)
  JAX_SDPA_KERNEL_MASK_FIELDS
  // Paged K/V (decode_tc_kernel<..., PAGED>; null otherwise): k / v strides are then
  // (page, head, slot) and Lk is pages_per_seq * page_size (SdpaParams' page fields).
  const int32_t* pages;
  int pages_per_seq, page_size, num_pages;
};

// ---- small device helpers ----------------------------------------------------

using cuda_common::cp_async16_l2;
using cuda_common::kEvictFirst;
using cuda_common::cp_async_commit;
using cuda_common::cp_async_wait;
using cuda_common::from_float;
using cuda_common::pack2;
using cuda_common::online_rescale;
using cuda_common::quad_max;
using cuda_common::quad_sum;
using cuda_common::SoftmaxExp;
using cuda_common::to_float;

// D = A(16x16, row) * B(16x8, col) + D, f32 accumulators (cuda_common::mma16816, free to
// schedule). A wrapper over scalars: calling cuda_common::mma16816 with the fragments' arrays
// in place reschedules decode_tc_kernel's machine code.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  const uint32_t a[4] = {a0, a1, a2, a3};
  cuda_common::mma16816<T, /*kVolatile=*/false>(d, a, b0, b1);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ uint32_t u4get(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// One 32-wide head-dim step of S = Q K^T on two 8-key n-tiles (mma m16n8k16): A = Q rows
// g (qa) and g + 8 (qb), B = K rows of n-tile 0 (k0) and 1 (k1). Of each 16-byte
// fragment, elements {0..3} feed the first k16 step and {4..7} the second.
template <typename T>
__device__ __forceinline__ void mma_qk_step(float (&s)[2][4], const uint4& qa, const uint4& qb,
                                            const uint4& k0, const uint4& k1) {
  mma16816<T>(s[0], qa.x, qb.x, qa.y, qb.y, k0.x, k0.y);
  mma16816<T>(s[1], qa.x, qb.x, qa.y, qb.y, k1.x, k1.y);
  mma16816<T>(s[0], qa.z, qb.z, qa.w, qb.w, k0.z, k0.w);
  mma16816<T>(s[1], qa.z, qb.z, qa.w, qb.w, k1.z, k1.w);
}

// PV's A fragment (V^T) of m-tile j from the 8 dv of the four V rows of mma keys 2t,
// 2t + 1, 2t + 8, 2t + 9 (v0..v3): m-tile j's rows g / g + 8 are the fragments' dv 2j /
// 2j + 1, so each register is two halves of two loaded words (prmt).
__device__ __forceinline__ void vt_fragment(const uint4& v0, const uint4& v1, const uint4& v2,
                                            const uint4& v3, int j, uint32_t (&A)[4]) {
  const uint32_t x0 = u4get(v0, j), x1 = u4get(v1, j), x2 = u4get(v2, j), x3 = u4get(v3, j);
  A[0] = prmt(x0, x1, 0x5410);
  A[1] = prmt(x0, x1, 0x7632);
  A[2] = prmt(x2, x3, 0x5410);
  A[3] = prmt(x2, x3, 0x7632);
}

// The four V rows of mma keys 2t, 2t + 1, 2t + 8, 2t + 9 at dv [dv, dv + 8) of a
// row-major smem tile of DVP-element rows (vt_fragment's inputs).
template <int DVP, typename T>
__device__ __forceinline__ void load_vt_rows(const T* Vs, int t, int dv, uint4& v0, uint4& v1,
                                             uint4& v2, uint4& v3) {
  v0 = *reinterpret_cast<const uint4*>(Vs + (2 * t) * DVP + dv);
  v1 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 1) * DVP + dv);
  v2 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 8) * DVP + dv);
  v3 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 9) * DVP + dv);
}

// Zeros every element of a (multi-dimensional) float array: accumulators, score tiles.
__device__ __forceinline__ void fill_zero(float& x) { x = 0.f; }
template <typename E, int N>
__device__ __forceinline__ void fill_zero(E (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fill_zero(x[i]);
}

// Query head h and query index i of row r of kv head kvh's rows (r = (h - kvh G) Lq + i).
// Plain decode (Lq = 1) skips the division: these run in every block's prologue.
struct HeadQuery {
  int h, i;
};
__device__ __forceinline__ HeadQuery head_query(const Args& a, int kvh, int r) {
  if (a.Lq == 1) return {kvh * a.G + r, 0};
  return {kvh * a.G + r / a.Lq, r % a.Lq};
}

// One query row of a block: which head / query it is and its visible key band.
struct RowInfo {
  int h, i;
  int first, last;  // visible keys [first, last) before the mask; empty if invalid
  int64_t mrow;     // mask offset of (b, h, i, 0)
};

__device__ __forceinline__ RowInfo row_info(const Args& a, int b, int kvh, int r, int qlen,
                                            int kvlen) {
  RowInfo ri;
  ri.first = 0;
  ri.last = 0;
  ri.h = 0;
  ri.i = 0;
  ri.mrow = 0;
  if (r >= a.R) return ri;
  const HeadQuery hq = head_query(a, kvh, r);
  ri.h = hq.h;
  ri.i = hq.i;
  ri.mrow = b * a.ms[0] + ri.h * a.ms[1] + ri.i * a.ms[2];
  if (ri.i >= qlen) return ri;
  const int64_t off = diagonal_offset(a.bottom_right != 0, qlen, kvlen);
  KeyRange kr = band_keys(ri.i, off, a.wl, a.wr, kvlen);
  ri.first = static_cast<int>(kr.first);
  ri.last = static_cast<int>(kr.last);
  return ri;
}

// Applies visibility + additive mask to a scaled (log2-domain) score.
__device__ __forceinline__ float masked_score(const Args& a, float s2, int j, int first, int last,
                                              int64_t mrow) {
  if (j < first || j >= last) return -INFINITY;
  if (a.mask_kind == static_cast<int>(MaskKind::kBool)) {
    if (reinterpret_cast<const uint8_t*>(a.mask)[mrow + j * a.ms[3]] == 0) return -INFINITY;
  } else if (a.mask_kind == static_cast<int>(MaskKind::kAdditive)) {
    const int64_t idx = mrow + j * a.ms[3];
    float mv;
    if (a.mask_dtype == static_cast<int>(DType::kF32))
      mv = reinterpret_cast<const float*>(a.mask)[idx];
    else if (a.mask_dtype == static_cast<int>(DType::kF16))
      mv = __half2float(reinterpret_cast<const __half*>(a.mask)[idx]);
    else
      mv = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(a.mask)[idx]);
    s2 += mv * kLog2e;  // -inf stays -inf: the key becomes invisible
  }
  return s2;
}

// A row's output scale and lse from its log2-domain max M and sum L = sum exp2(s - M):
// folds in the sink; scale = 0 and lse = -inf for a row with nothing visible or past
// q_length. out = (unnormalized o) * scale.
__device__ __forceinline__ void row_normalizer(const Args& a, int b, int h, int i, int qlen,
                                               float M, float L, float* scale, float* lse) {
  *scale = 0.f;
  *lse = -INFINITY;
  if (i >= qlen) return;
  const float sk = a.sinks != nullptr ? a.sinks[b * a.sinks_bs + h] * kLog2e : -INFINITY;
  if (L != L || sk != sk) {  // a visible NaN score (max skips NaN, the sum keeps it) or sink
    *scale = *lse = __int_as_float(0x7fc00000);
    return;
  }
  const float M2 = fmaxf(M, sk);
  if (M2 == -INFINITY) return;
  const float fo = (M == -INFINITY) ? 0.f : exp2f(M - M2);
  const float L2 = L * fo + exp2f(sk - M2);
  if (L2 > 0.f) {
    *scale = __fdividef(fo, L2);  // L2 in [tiny, 2^32]: no IEEE slow-path call
    *lse = (M2 + log2f(L2)) * kLn2;
  }
}

// o * scale, or 0 where scale is 0 (an empty row, a row past q length): selected, so a NaN
// that reached o through P = 0 stays out.
__device__ __forceinline__ float4 scaled_row(float4 o, float scale) {
  if (scale == 0.f) return make_float4(0.f, 0.f, 0.f, 0.f);
  return make_float4(o.x * scale, o.y * scale, o.z * scale, o.w * scale);
}

// Four consecutive outputs (dst 4-element aligned: every built Dv is a multiple of 4).
template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 o) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(dst) = o;
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(o.x, o.y), pack2<T>(o.z, o.w));
  }
}

__device__ __forceinline__ int64_t out_offset(const Args& a, int b, int h, int i) {
  return b * a.os[0] + h * a.os[1] + i * a.os[2];
}

// Merges the block's warps after the key loop. Shared memory: red_m/red_l [W][16],
// red_o [W][16][DV] (each warp's max, sum and unnormalized output per row).
// One thread per row first folds the warps' max/sum (and the sink, or the split's
// lse) into per-warp coefficients, so that the wide pass over the block's RB x DV
// outputs is W float4 loads and FMAs per 4 outputs. XW more warps (after the W that
// computed: decode_tma_kernel's producer) pass the barriers and take no work.

// Row rr of a block's W warps merged: the row max M (returned), each warp's weight
// f[w] (registers or shared memory) = 2^(m_w - M) and the merged sum *L = sum_w f[w] l_w, from the warps' maxima red_m and
// sums red_l ([W][16]). Not skipped when M = -inf: a warp whose scores were all NaN has max
// -inf and a NaN sum, which must reach L (f = 0 there, and 0 * NaN is NaN).
template <int W>
__device__ __forceinline__ float merge_warp_stats(const float* red_m, const float* red_l, int rr,
                                                  float* f, float* L) {
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < W; ++w) M = fmaxf(M, red_m[w * 16 + rr]);
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const float mw = red_m[w * 16 + rr];
    const float fw = mw == -INFINITY ? 0.f : exp2f(mw - M);
    f[w] = fw;
    sum += fw * red_l[w * 16 + rr];
  }
  *L = sum;
  return M;
}
template <typename T, int DV, int W, int XW = 0>
__device__ __forceinline__ void block_finish(const Args& a, float* red, int RB, int b,
                                             int kvh, int r0, int split, int qlen) {
  const float* red_m = red;
  const float* red_l = red + W * 16;
  const float* red_o = red + 2 * W * 16;
  const int nthreads = W * 32;
  const bool idle = XW > 0 && threadIdx.x >= nthreads;
  __shared__ float s_coef[16][W];
  __shared__ int64_t s_dst[16];  // element offset of the row's dv 0 in out / part_o; -1: none
  __shared__ bool s_zero[16];    // the row's (partial) output is 0: selected, not multiplied
  if (threadIdx.x < RB) {
    const int rr = threadIdx.x, r = r0 + rr;
    int64_t dst = -1;
    bool zero = true;
    float f[W];
#pragma unroll
    for (int w = 0; w < W; ++w) f[w] = 0.f;
    if (r < a.R) {
      const HeadQuery hq = head_query(a, kvh, r);
      const int h = hq.h, i = hq.i;
      const int64_t grow = (static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i;
      float L;
      const float M = merge_warp_stats<W>(red_m, red_l, rr, f, &L);
      float scale, lse;
      if (a.nsplit == 1) {
        row_normalizer(a, b, h, i, qlen, M, L, &scale, &lse);
        a.lse[grow] = lse;
        dst = out_offset(a, b, h, i);
      } else {
        const int64_t pr = static_cast<int64_t>(split) * a.rows + grow;
        const bool empty = cuda_common::softmax_row_empty(L);  // a NaN L is not
        scale = empty ? 0.f : __fdividef(1.f, L);
        a.part_lse[pr] = empty ? -INFINITY : M + log2f(L);
        dst = pr * DV;
      }
      zero = scale == 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) f[w] *= scale;
    }
#pragma unroll
    for (int w = 0; w < W; ++w) s_coef[rr][w] = f[w];
    s_dst[rr] = dst;
    s_zero[rr] = zero;
  }
  __syncthreads();
  constexpr int DV4 = DV / 4;
  for (int idx = idle ? RB * DV4 : threadIdx.x; idx < RB * DV4; idx += nthreads) {
    const int rr = idx / DV4, c = idx - rr * DV4;
    const int64_t dst = s_dst[rr];
    if (dst < 0) continue;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (!s_zero[rr]) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float cw = s_coef[rr][w];
        const float4 x = *reinterpret_cast<const float4*>(red_o + (w * 16 + rr) * DV + 4 * c);
        o.x = fmaf(cw, x.x, o.x);
        o.y = fmaf(cw, x.y, o.y);
        o.z = fmaf(cw, x.z, o.z);
        o.w = fmaf(cw, x.w, o.w);
      }
    }
    if (a.nsplit == 1)
      store4<T>(reinterpret_cast<T*>(a.out) + dst + 4 * c, o);
    else
      *reinterpret_cast<float4*>(a.part_o + dst + 4 * c) = o;
  }
  if (a.nsplit == 1 || a.counters == nullptr) return;

  // Fused combine: the last split block of this unit to finish merges all the
  // splits (saves the combine launch and its wait). Release: partials, fence,
  // count; acquire: count, fence, L2 reads (__ldcg: never a stale L1 line).
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(&a.counters[blockIdx.x], 1);
    s_last = prev == a.nsplit - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // One serial pass over the splits per output element is latency-bound (seen:
  // 100-250 us at 8-33 splits), so: (1) a warp per row reduces the splits' lse
  // to M, L and per-split weights in smem (the warp partials in `red` are dead:
  // every thread passed the barrier above); (2) each thread accumulates float4s
  // of the weighted partials with independent loads in flight. nsplit <= 256
  // (host) keeps the weights within every kernel's smem.
  float* wts = red;                          // [RB][nsplit]
  float* rowM = red + RB * a.nsplit;         // [RB]
  float* rowL = rowM + RB;                   // [RB]
  {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int rr = idle ? RB : warp; rr < RB; rr += W) {  // warp-uniform loop
      const int r = r0 + rr;
      if (r >= a.R) continue;
      const HeadQuery hq = head_query(a, kvh, r);
      const int h = hq.h, i = hq.i;
      const int64_t grow = (static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i;
      float M = -INFINITY;
      for (int sp = lane; sp < a.nsplit; sp += 32)
        M = fmaxf(M, __ldcg(a.part_lse + sp * a.rows + grow));
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
      float L = 0.f;
      for (int sp = lane; sp < a.nsplit; sp += 32) {
        const float ls = __ldcg(a.part_lse + sp * a.rows + grow);
        // M = -inf with a NaN ls (a split of a NaN row): the weight is NaN, never 0.
        const float wgt = ls == -INFINITY ? 0.f : exp2f(ls - M);
        wts[rr * a.nsplit + sp] = wgt;
        L += wgt;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
      if (lane == 0) {
        rowM[rr] = M;
        rowL[rr] = L;
      }
    }
  }
  __syncthreads();
  for (int idx = idle ? RB * DV4 : threadIdx.x; idx < RB * DV4; idx += nthreads) {
    const int rr = idx / DV4, c = idx - rr * DV4;
    const int r = r0 + rr;
    if (r >= a.R) continue;
    const HeadQuery hq = head_query(a, kvh, r);
    const int h = hq.h, i = hq.i;
    const int64_t grow = (static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i;
    const float* src = a.part_o + grow * DV + 4 * c;
    const int64_t sstride = a.rows * DV;
    const float* w = wts + rr * a.nsplit;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int sp = 0; sp < a.nsplit; ++sp) {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(src + sp * sstride));
      const float wgt = w[sp];
      o.x = fmaf(wgt, x.x, o.x);
      o.y = fmaf(wgt, x.y, o.y);
      o.z = fmaf(wgt, x.z, o.z);
      o.w = fmaf(wgt, x.w, o.w);
    }
    float scale, lse;
    row_normalizer(a, b, h, i, qlen, rowM[rr], rowL[rr], &scale, &lse);
    if (c == 0) a.lse[grow] = lse;
    store4<T>(reinterpret_cast<T*>(a.out) + out_offset(a, b, h, i) + 4 * c,
              scaled_row(o, scale));
  }
  if (threadIdx.x == 0) a.counters[blockIdx.x] = 0;  // ready for the next call on this stream
}

// The block's key range [ks0, ks1) for this split: the union of its rows' ranges cut
// into nsplit chunks of a multiple of GRAN keys (the kernel's key step).
template <int GRAN = kTileKeys>
__device__ __forceinline__ void split_range(const Args& a, int r0, int RB, int split, int qlen,
                                            int kvlen, int* ks0, int* ks1) {
  // A row's keys depend only on its query i = r % Lq, and the block's rows r0 .. r1 - 1
  // are consecutive: their i run through min(r1 - r0, Lq) distinct values from r0 % Lq.
  // So visit each once (one, not RB, for plain decode), with one division: this runs
  // before the producer's first copy.
  int kb0 = INT_MAX, kb1 = 0;
  const int n = min(min(r0 + RB, a.R) - r0, a.Lq);
  const int64_t off = diagonal_offset(a.bottom_right != 0, qlen, kvlen);
  int i = r0 % a.Lq;
  for (int k = 0; k < n; ++k, i = (i + 1 == a.Lq ? 0 : i + 1)) {
    if (i >= qlen) continue;
    const KeyRange kr = band_keys(i, off, a.wl, a.wr, kvlen);
    if (kr.last > kr.first) {
      kb0 = min(kb0, static_cast<int>(kr.first));
      kb1 = max(kb1, static_cast<int>(kr.last));
    }
  }
  if (kb1 <= kb0) {
    *ks0 = *ks1 = 0;
    return;
  }
  int chunk = (kb1 - kb0 + a.nsplit - 1) / a.nsplit;
  chunk = (chunk + GRAN - 1) / GRAN * GRAN;
  const long long s0 = kb0 + static_cast<long long>(split) * chunk;
  *ks0 = static_cast<int>(s0 < kb1 ? s0 : kb1);
  *ks1 = static_cast<int>(min(static_cast<long long>(kb1), s0 + chunk));
  if (*ks1 < *ks0) *ks1 = *ks0;
}

// What a block owns (work decomposition at the top of this file): batch b, kv head kvh,
// its rows' first row r0 (RB rows a block), the key split, and the batch row's lengths.
// The split's keys come from split_range.
struct BlockWork {
  int b, kvh, r0, split, qlen, kvlen;
};
__device__ __forceinline__ BlockWork block_work(const Args& a, int RB) {
  BlockWork wk;
  // (One row chunk, the usual case, skips a division.)
  const int rc = a.row_chunks == 1 ? 0 : blockIdx.x % a.row_chunks;
  const int bk = a.row_chunks == 1 ? blockIdx.x : blockIdx.x / a.row_chunks;
  wk.kvh = bk % a.Hk;
  wk.b = bk / a.Hk;
  wk.split = blockIdx.y;
  wk.qlen = static_cast<int>(clamp_length(a.qlen, wk.b, a.Lq));
  wk.kvlen = static_cast<int>(clamp_length(a.kvlen, wk.b, a.Lk));
  wk.r0 = rc * RB;
  return wk;
}

// block_work and the split's keys [*ks0, *ks1) (split_range at key step GRAN).
template <int GRAN = kTileKeys>
__device__ __forceinline__ BlockWork block_keys(const Args& a, int RB, int* ks0, int* ks1) {
  const BlockWork wk = block_work(a, RB);
  split_range<GRAN>(a, wk.r0, RB, wk.split, wk.qlen, wk.kvlen, ks0, ks1);
  return wk;
}
// The number of GRAN-key steps (tiles, stages) of keys [ks0, ks1).
template <int GRAN = kTileKeys>
__device__ __forceinline__ int key_steps(int ks0, int ks1) {
  return (ks1 - ks0 + GRAN - 1) / GRAN;
}

// Where kv head kvh of batch row b starts in K or V (data p, strides st): a key loop's
// base. PAGED: the page pools, no batch offset (the page table places each key).
template <typename T, bool PAGED = false>
__device__ __forceinline__ const T* kv_head_base(const void* p, const int64_t (&st)[3], int b,
                                                 int kvh) {
  return reinterpret_cast<const T*>(p) + (PAGED ? 0 : b * st[0]) + kvh * st[1];
}

// The block's query rows r0 .. r0 + NROWS - 1 -> smem rows of QP elements (zeros past
// the RB rows of the block or the R rows of the group), 16 bytes a thread and step.
template <typename T, int D, int QP, int NROWS, int RB, int NTHR>
__device__ __forceinline__ void load_q_rows(T* Qs, const Args& a, int b, int kvh, int r0,
                                            int tid) {
  constexpr int EPV = 16 / sizeof(T);
  constexpr int QC = D / EPV;
  for (int idx = tid; idx < NROWS * QC; idx += NTHR) {
    const int rr = idx / QC, c = idx - rr * QC;
    const int r = r0 + rr;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (rr < RB && r < a.R) {
      const HeadQuery hq = head_query(a, kvh, r);
      const int h = hq.h, i = hq.i;
      const T* src =
          reinterpret_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1] + i * a.qs[2] + c * EPV;
      val = *reinterpret_cast<const uint4*>(src);
    }
    *reinterpret_cast<uint4*>(Qs + rr * QP + c * EPV) = val;
  }
}

// Copies 16 rows (keys j0..j0+15) of C 16-byte chunks each into smem rows of P
// elements with NTHR threads that tile whole rows (NTHR % C == 0: NTHR / C keys a step);
// rows >= jend are zero-filled (never read: a fixed-size cache may hold garbage past its
// length). Each thread keeps one source pointer and steps it by a constant: a few
// instructions per 16-byte copy instead of an index division and a 64-bit multiply each.
template <typename T, int C, int P, int PF, int NTHR>
__device__ __forceinline__ void load_rows_by(T* dst, const T* base, int64_t st, int j0, int jend,
                                             int tid) {
  constexpr int EPV = 16 / sizeof(T);
  static_assert(NTHR % C == 0 && kTileKeys % (NTHR / C) == 0, "decode: copy shape");
  constexpr int KPI = NTHR / C;
  const int key0 = tid / C, c = tid % C;
  const T* src = base + static_cast<int64_t>(j0 + key0) * st + c * EPV;
  T* d = dst + key0 * P + c * EPV;
#pragma unroll
  for (int m = 0; m < kTileKeys / KPI; ++m) {
    const bool ok = j0 + key0 + m * KPI < jend;
    cp_async16_l2<PF>(d + m * KPI * P, ok ? src : base, ok);
    src += KPI * st;
  }
}

// The same with one warp: load_rows_by when its 32 lanes tile whole rows (32 % C == 0);
// when a row is whole warps (C % 32 == 0) each lane steps its pointer key by key.
template <typename T, int C, int P, int PF>
__device__ __forceinline__ void load_rows(T* dst, const T* base, int64_t st, int j0, int jend,
                                          int lane) {
  constexpr int EPV = 16 / sizeof(T);
  if constexpr (32 % C == 0) {
    load_rows_by<T, C, P, PF, 32>(dst, base, st, j0, jend, lane);
  } else if constexpr (C % 32 == 0) {
    const T* src = base + static_cast<int64_t>(j0) * st + lane * EPV;
    T* d = dst + lane * EPV;
#pragma unroll 4
    for (int key = 0; key < kTileKeys; ++key) {
      const bool ok = j0 + key < jend;
#pragma unroll
      for (int q = 0; q < C / 32; ++q)
        cp_async16_l2<PF>(d + key * P + 32 * q * EPV, ok ? src + 32 * q * EPV : base, ok);
      src += st;
    }
  } else {
#pragma unroll 4
    for (int idx = lane; idx < kTileKeys * C; idx += 32) {
      const int key = idx / C, c = idx - key * C;
      const int j = j0 + key;
      const bool ok = j < jend;
      cp_async16_l2<PF>(dst + key * P + c * EPV, base + (ok ? j * st : 0) + c * EPV, ok);
    }
  }
}

// ---- paged K/V ------------------------------------------------------------------
// Key j0 + r of a tile (r < 16) lives at page * st[0] + slot * st[2] of the pools, found
// through its batch row's page-table row `table` by lane r once a tile: the lane's K and V
// offsets, and the warp's bitmask of the tile's readable keys (below jend, on a page index
// inside [0, num_pages): cuda_common::checked_page). Keys outside it are never read.
// The lookup is two steps so that a kernel can load a tile's table entry (paged_entry) a
// tile step before it needs the offsets (paged_rows): the load's latency then hides behind
// that step instead of stalling the warp's next copies.
struct PagedRows {
  int64_t koff, voff;  // lane r's key row (lanes 16..31: lane - 16's)
  unsigned readable;   // bit r: key j0 + r is read
};

// Lane r's page-table entry for key j0 + r (lanes 16..31: lane - 16's); -1 past jend.
__device__ __forceinline__ int paged_entry(const Args& a, const int32_t* table, int j0, int jend,
                                           int lane) {
  const int j = j0 + (lane & 15);
  return j < jend ? table[j / a.page_size] : -1;
}

// The tile's rows from each lane's paged_entry for the same j0.
__device__ __forceinline__ PagedRows paged_rows(const Args& a, int entry, int j0, int lane) {
  const int j = j0 + (lane & 15);
  const int page = cuda_common::checked_page(entry, a.num_pages);
  const int slot = j % a.page_size;
  PagedRows r;
  r.koff = page >= 0 ? page * a.ks[0] + slot * a.ks[2] : 0;
  r.voff = page >= 0 ? page * a.vs[0] + slot * a.vs[2] : 0;
  r.readable = __ballot_sync(0xffffffffu, page >= 0) & 0xffffu;
  return r;
}

// One warp copies the C 16-byte chunks of each of the tile's 16 key rows at base + lane
// r's offset `off` (shuffled to the copying lanes); unreadable rows are zero-filled.
template <typename T, int C, int P, int PF>
__device__ __forceinline__ void load_paged_rows(T* dst, const T* base, int64_t off,
                                                unsigned readable, int lane) {
  constexpr int EPV = 16 / sizeof(T);
  static_assert((kTileKeys * C) % 32 == 0, "decode: paged copy shape");
#pragma unroll
  for (int it = 0; it < kTileKeys * C / 32; ++it) {
    const int idx = it * 32 + lane;
    const int key = idx / C, c = idx - key * C;
    const int64_t row = __shfl_sync(0xffffffffu, off, key);
    const bool ok = (readable >> key) & 1u;
    cp_async16_l2<PF>(dst + key * P + c * EPV, base + (ok ? row : 0) + c * EPV, ok);
  }
}

template <typename T, int D, int DV, int DP, int DVP, int PF>
__device__ __forceinline__ void load_paged_tile(T* stage, const T* kbase, const T* vbase,
                                                const PagedRows& rows, int lane) {
  constexpr int EPV = 16 / sizeof(T);
  load_paged_rows<T, D / EPV, DP, PF>(stage, kbase, rows.koff, rows.readable, lane);
  load_paged_rows<T, DV / EPV, DVP, PF>(stage + kTileKeys * DP, vbase, rows.voff,
                                        rows.readable, lane);
}

// Issues the cp.async copies of one 16-key tile of K (D wide) and V (DV wide)
// into a ring stage [16][DP] + [16][DVP]; PF: L2 prefetch bytes (0, 128, 256).
template <typename T, int D, int DV, int DP, int DVP, int PF>
__device__ __forceinline__ void load_tile(T* stage, const T* kbase, const T* vbase, int64_t kst,
                                          int64_t vst, int j0, int jend, int lane) {
  constexpr int EPV = 16 / sizeof(T);
  load_rows<T, D / EPV, DP, PF>(stage, kbase, kst, j0, jend, lane);
  load_rows<T, DV / EPV, DVP, PF>(stage + kTileKeys * DP, vbase, vst, j0, jend, lane);
}

// The same with a whole block of NTHR threads (load_rows_by), for kernels whose warps
// share each tile.
template <typename T, int D, int DV, int DP, int DVP, int PF, int NTHR>
__device__ __forceinline__ void load_tile_by(T* stage, const T* kbase, const T* vbase,
                                             int64_t kst, int64_t vst, int j0, int jend, int tid) {
  constexpr int EPV = 16 / sizeof(T);
  load_rows_by<T, D / EPV, DP, PF, NTHR>(stage, kbase, kst, j0, jend, tid);
  load_rows_by<T, DV / EPV, DVP, PF, NTHR>(stage + kTileKeys * DP, vbase, vst, j0, jend, tid);
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
