// Decode (few-query) attention kernels: split-K over keys, GQA rows packed per
// block, cp.async 16-byte loads into a per-warp shared-memory ring, bf16/fp16 on
// tensor cores and fp32 on CUDA cores. Host side: decode_attention.cu.
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

#include "cuda/device_helpers.cuh"
#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_decode {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kTileKeys = 16;

// Everything a kernel needs, by value (kernel parameter space).
struct Args {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  float* part_o;    // [splits][rows][Dv] normalized partial outputs
  float* part_lse;  // [splits][rows] log2-domain lse of each split
  int* counters;    // per block unit: splits done (fused combine), self-resetting; or null
  int B, Hq, Hk, Lq, Lk, G, R;  // R = G * Lq rows per kv head
  int RB, row_chunks, nsplit;
  int64_t rows;  // B * Hq * Lq
  int64_t qs[3], ks[3], vs[3], os[3];
  float scale_log2;  // scale * log2(e)
  int64_t wl, wr;
  int bottom_right;
  int mask_kind, mask_dtype;
  const void* mask;
  int64_t ms[4];
  const float* sinks;
  int64_t sinks_bs;
  const int32_t* qlen;
  const int32_t* kvlen;
};

// ---- small device helpers ----------------------------------------------------

using cuda_common::cp_async16_l2;
using cuda_common::kEvictFirst;
using cuda_common::cp_async_commit;
using cuda_common::cp_async_wait;
using cuda_common::from_float;
using cuda_common::pack2;
using cuda_common::to_float;

// D = A(16x16, row) * B(16x8, col) + D, f32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], uint32_t a0, uint32_t a1,
                                                        uint32_t a2, uint32_t a3, uint32_t b0,
                                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], uint32_t a0, uint32_t a1,
                                                 uint32_t a2, uint32_t a3, uint32_t b0,
                                                 uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ uint32_t u4get(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
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
  const float M2 = fmaxf(M, sk);
  if (M2 == -INFINITY) return;
  const float fo = (M == -INFINITY) ? 0.f : exp2f(M - M2);
  const float L2 = L * fo + exp2f(sk - M2);
  if (L2 > 0.f) {
    *scale = __fdividef(fo, L2);  // L2 in [tiny, 2^32]: no IEEE slow-path call
    *lse = (M2 + log2f(L2)) * kLn2;
  }
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
  if (threadIdx.x < RB) {
    const int rr = threadIdx.x, r = r0 + rr;
    int64_t dst = -1;
    float f[W];
#pragma unroll
    for (int w = 0; w < W; ++w) f[w] = 0.f;
    if (r < a.R) {
      const HeadQuery hq = head_query(a, kvh, r);
      const int h = hq.h, i = hq.i;
      const int64_t grow = (static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < W; ++w) M = fmaxf(M, red_m[w * 16 + rr]);
      float L = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const float mw = red_m[w * 16 + rr];
          f[w] = mw == -INFINITY ? 0.f : exp2f(mw - M);
          L += f[w] * red_l[w * 16 + rr];
        }
      }
      float scale, lse;
      if (a.nsplit == 1) {
        row_normalizer(a, b, h, i, qlen, M, L, &scale, &lse);
        a.lse[grow] = lse;
        dst = out_offset(a, b, h, i);
      } else {
        const int64_t pr = static_cast<int64_t>(split) * a.rows + grow;
        scale = L > 0.f ? __fdividef(1.f, L) : 0.f;
        a.part_lse[pr] = L > 0.f ? M + log2f(L) : -INFINITY;
        dst = pr * DV;
      }
#pragma unroll
      for (int w = 0; w < W; ++w) f[w] *= scale;
    }
#pragma unroll
    for (int w = 0; w < W; ++w) s_coef[rr][w] = f[w];
    s_dst[rr] = dst;
  }
  __syncthreads();
  constexpr int DV4 = DV / 4;
  for (int idx = idle ? RB * DV4 : threadIdx.x; idx < RB * DV4; idx += nthreads) {
    const int rr = idx / DV4, c = idx - rr * DV4;
    const int64_t dst = s_dst[rr];
    if (dst < 0) continue;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float cw = s_coef[rr][w];
      const float4 x = *reinterpret_cast<const float4*>(red_o + (w * 16 + rr) * DV + 4 * c);
      o.x = fmaf(cw, x.x, o.x);
      o.y = fmaf(cw, x.y, o.y);
      o.z = fmaf(cw, x.z, o.z);
      o.w = fmaf(cw, x.w, o.w);
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
        const float wgt = (M == -INFINITY || ls == -INFINITY) ? 0.f : exp2f(ls - M);
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
              make_float4(o.x * scale, o.y * scale, o.z * scale, o.w * scale));
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

// Issues the cp.async copies of one 16-key tile of K (D wide) and V (DV wide)
// into a ring stage [16][DP] + [16][DVP]; PF: L2 prefetch bytes (0, 128, 256).
template <typename T, int D, int DV, int DP, int DVP, int PF>
__device__ __forceinline__ void load_tile(T* stage, const T* kbase, const T* vbase, int64_t kst,
                                          int64_t vst, int j0, int jend, int lane) {
  constexpr int EPV = 16 / sizeof(T);
  load_rows<T, D / EPV, DP, PF>(stage, kbase, kst, j0, jend, lane);
  load_rows<T, DV / EPV, DVP, PF>(stage + kTileKeys * DP, vbase, vst, j0, jend, lane);
}

// ---- bf16 / fp16: tensor cores -------------------------------------------------
//
// One warp's 16-key tile on tensor cores, shared by decode_tc_kernel and
// decode_tma_kernel: S = Q K^T (mma m16n8k16, Q rows as A, two 8-key n-tiles of K as
// B), the online softmax update of the rows' max / sum (log2 domain), then O^T += V^T
// P^T (V^T as A, 16 dv rows; P^T as B, n = 8 query rows). The kernels differ only in
// where the fragments live, given as callables:
//   qk(c, qa, qb, k0, k1): QK step c's 16-byte fragments: Q rows g, g + 8 and the K rows of
//                          mma keys g, g + 8 (thread t's 8 head dims of the step; the
//                          same head-dim order for Q and K)
//   key(n, e1):            the key index of score element s[n][e], e1 = e & 1 (mma key
//                          8n + 2t + e1)
//   pv(c, v0, v1, v2, v3): PV step c's fragments: 8 dv of thread row g from the V rows of
//                          mma keys 2t, 2t + 1, 2t + 8, 2t + 9
// S's accumulator layout is P^T's B layout, so P never leaves registers.
template <typename T, int D, int DV, int NT, class QK, class Key, class PV>
__device__ __forceinline__ void tc_tile_step(const Args& a, const RowInfo& rowA,
                                             const RowInfo& rowB, QK qk, Key key, PV pv,
                                             float& mA, float& mB, float& lA, float& lB,
                                             float (&acc)[(DV + 63) / 64][4][NT][4]) {
  constexpr int NKC = (D + 31) / 32;   // 32-wide head-dim steps (QK)
  constexpr int NVC = (DV + 63) / 64;  // 64-wide dv steps (PV)
  const int lane = threadIdx.x & 31, t = lane & 3;
  // S = Q K^T. Of each 16-byte fragment, elements {0..3} feed the first k16 step and
  // {4..7} the second (logical k = 2t, 2t+1, 2t+8, 2t+9 = the fragment's 0..3, then
  // 4..7). Two accumulator sets (even / odd steps) halve the dependent mma chain (D512:
  // 32 -> 16 deep), which bounds a warp's tile time at one warp per scheduler.
  float s[2][4], s_odd[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = s_odd[n][e] = 0.f;
#pragma unroll
  for (int c = 0; c < NKC; ++c) {
    float(&sc)[2][4] = (c & 1) ? s_odd : s;
    uint4 qa, qb, k0, k1;
    qk(c, qa, qb, k0, k1);
    mma16816<T>(sc[0], qa.x, qb.x, qa.y, qb.y, k0.x, k0.y);
    mma16816<T>(sc[1], qa.x, qb.x, qa.y, qb.y, k1.x, k1.y);
    mma16816<T>(sc[0], qa.z, qb.z, qa.w, qb.w, k0.z, k0.w);
    mma16816<T>(sc[1], qa.z, qb.z, qa.w, qb.w, k1.z, k1.w);
  }
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] += s_odd[n][e];

  // s[n][e]: row g (e < 2) or g + 8, key key(n, e & 1).
  float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = key(n, e & 1);
      const bool upper = e >= 2;
      if (upper && NT == 1) {
        s[n][e] = -INFINITY;
        continue;
      }
      // Scalar selects (a reference to either struct would put both on the stack).
      const int first = upper ? rowB.first : rowA.first;
      const int last = upper ? rowB.last : rowA.last;
      const int64_t mrow = upper ? rowB.mrow : rowA.mrow;
      s[n][e] = masked_score(a, s[n][e] * a.scale_log2, j, first, last, mrow);
      if (upper)
        mxB = fmaxf(mxB, s[n][e]);
      else
        mxA = fmaxf(mxA, s[n][e]);
    }
  mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
  mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
  const float mnA = fmaxf(mA, mxA);
  const float muA = mnA == -INFINITY ? 0.f : mnA;
  const float alA = exp2f(mA - muA);
  mA = mnA;
  float alB = 1.f, muB = 0.f;
  if (NT == 2) {
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
    const float mnB = fmaxf(mB, mxB);
    muB = mnB == -INFINITY ? 0.f : mnB;
    alB = exp2f(mB - muB);
    mB = mnB;
  }
  float sumA = 0.f, sumB = 0.f;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    s[n][0] = exp2f(s[n][0] - muA);
    s[n][1] = exp2f(s[n][1] - muA);
    sumA += s[n][0] + s[n][1];
    if (NT == 2) {
      s[n][2] = exp2f(s[n][2] - muB);
      s[n][3] = exp2f(s[n][3] - muB);
      sumB += s[n][2] + s[n][3];
    }
  }
  lA = lA * alA + sumA;  // per-thread partial; quad-reduced at the end
  if (NT == 2) lB = lB * alB + sumB;

  // Rescale O^T: its columns are query rows 2t, 2t+1 (+8 for the second n-tile);
  // their alphas live in lanes 4 * row. Skipped (warp-uniform) once no row's max
  // moves, the common case after the first tiles.
  if (__any_sync(0xffffffffu, alA != 1.f || alB != 1.f)) {
    const float a0 = __shfl_sync(0xffffffffu, alA, (2 * t) * 4);
    const float a1 = __shfl_sync(0xffffffffu, alA, (2 * t + 1) * 4);
    float b0 = 1.f, b1 = 1.f;
    if (NT == 2) {
      b0 = __shfl_sync(0xffffffffu, alB, (2 * t) * 4);
      b1 = __shfl_sync(0xffffffffu, alB, (2 * t + 1) * 4);
    }
#pragma unroll
    for (int c = 0; c < NVC; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[c][j][0][0] *= a0;
        acc[c][j][0][1] *= a1;
        acc[c][j][0][2] *= a0;
        acc[c][j][0][3] *= a1;
        if (NT == 2) {
          acc[c][j][NT - 1][0] *= b0;
          acc[c][j][NT - 1][1] *= b1;
          acc[c][j][NT - 1][2] *= b0;
          acc[c][j][NT - 1][3] *= b1;
        }
      }
  }

  // P^T as B (k = key, n = query row): (keys 2t, 2t+1 | 2t+8, 2t+9; row g) is
  // exactly what this thread holds in s.
  uint32_t pb[NT][2];
  pb[0][0] = pack2<T>(s[0][0], s[0][1]);
  pb[0][1] = pack2<T>(s[1][0], s[1][1]);
  if (NT == 2) {
    pb[NT - 1][0] = pack2<T>(s[0][2], s[0][3]);
    pb[NT - 1][1] = pack2<T>(s[1][2], s[1][3]);
  }

  // O^T += V^T P^T. m-tile j's rows g / g+8 are the fragment's dv 2j / 2j+1, so each A
  // register is two halves of two loaded words (prmt).
#pragma unroll
  for (int c = 0; c < NVC; ++c) {
    uint4 v0, v1, v2, v3;
    pv(c, v0, v1, v2, v3);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t x0 = u4get(v0, j), x1 = u4get(v1, j), x2 = u4get(v2, j),
                     x3 = u4get(v3, j);
      const uint32_t A0 = prmt(x0, x1, 0x5410), A1 = prmt(x0, x1, 0x7632);
      const uint32_t A2 = prmt(x2, x3, 0x5410), A3 = prmt(x2, x3, 0x7632);
#pragma unroll
      for (int n = 0; n < NT; ++n) mma16816<T>(acc[c][j][n], A0, A1, A2, A3, pb[n][0], pb[n][1]);
    }
  }
}


//
// decode_tc_kernel: each warp streams its own 16-key tiles (tc_tile_step), 8 packed
// query rows waste no accumulator. Fragments are read straight from the row-major,
// padded smem tiles with 16-byte loads: the head dim inside each 32-wide chunk and the
// dv rows inside each 64-wide chunk are permuted consistently (see the kernel), which
// needs no ldmatrix and no transpose.
template <typename T, int D, int DV, int NT, int W, int S>
struct TcConfig {
  static constexpr int kThreads = W * 32;
  // Row pads against bank conflicts: the QK reads of a quarter-warp cover 64 B of
  // two adjacent K rows (stride wanted = 64 mod 128 B); the PV reads cover 16 B
  // of four rows 2 apart (stride wanted = 16 mod 32 B). (Unpadded rows, so that each
  // 128-byte global line lands on an aligned smem line, were slower and left the L2 hit
  // rate as it was: docs/cuda_decode.md.)
  static constexpr int DP = D + ((64 - (D * 2) % 128) + 128) % 128 / 2;
  static constexpr int DVP = DV + 8;
  static constexpr int kStage = kTileKeys * (DP + DVP);
  static constexpr size_t kQBytes = 16 * DP * sizeof(T);
  static constexpr size_t kRingBytes = static_cast<size_t>(W) * S * kStage * sizeof(T);
  static constexpr size_t kRedBytes = static_cast<size_t>(W) * 16 * (2 + DV) * sizeof(float);
  static constexpr size_t kSmem =
      (kQBytes + kRingBytes) > kRedBytes ? (kQBytes + kRingBytes) : kRedBytes;
};

// PF: the copies' L2 mode (cp_async16_l2).
template <typename T, int D, int DV, int NT, int W, int S, int PF>
__global__ void __launch_bounds__(W * 32, 1) decode_tc_kernel(const Args a) {
  using Cfg = TcConfig<T, D, DV, NT, W, S>;
  constexpr int DP = Cfg::DP, DVP = Cfg::DVP, STAGE = Cfg::kStage;
  constexpr int RB = NT * 8;
  constexpr int NVC = (DV + 63) / 64;  // 64-wide dv chunks (PV)
  extern __shared__ __align__(16) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);  // [16][DP]
  T* ring = reinterpret_cast<T*>(smem + Cfg::kQBytes);

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const BlockWork wk = block_work(a, RB);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  const int kvlen = wk.kvlen;
  int ks0, ks1;
  split_range(a, r0, RB, split, qlen, kvlen, &ks0, &ks1);
  const int ntiles = (ks1 - ks0 + kTileKeys - 1) / kTileKeys;
  const int my_tiles = ntiles > w ? (ntiles - w + W - 1) / W : 0;

  const T* kbase = reinterpret_cast<const T*>(a.k) + b * a.ks[0] + kvh * a.ks[1];
  const T* vbase = reinterpret_cast<const T*>(a.v) + b * a.vs[0] + kvh * a.vs[1];
  T* myring = ring + w * S * STAGE;

  // Start the first tiles' copies before anything else.
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < my_tiles)
      load_tile<T, D, DV, DP, DVP, PF>(myring + st * STAGE, kbase, vbase, a.ks[2], a.vs[2],
                                   ks0 + (w + st * W) * kTileKeys, ks1, lane);
    cp_async_commit();
  }

  // Q rows of the block -> smem (zeros past the group / chunk).
  load_q_rows<T, D, DP, 16, RB, Cfg::kThreads>(Qs, a, b, kvh, r0, tid);
  __syncthreads();

  const RowInfo rowA = row_info(a, b, kvh, r0 + g, qlen, kvlen);
  RowInfo rowB = rowA;
  if (NT == 2) rowB = row_info(a, b, kvh, r0 + g + 8, qlen, kvlen);

  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  float acc[NVC][4][NT][4];
#pragma unroll
  for (int c = 0; c < NVC; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[c][j][n][e] = 0.f;

  for (int it = 0; it < my_tiles; ++it) {
    {
      const int nx = it + S - 1;
      if (nx < my_tiles)
        load_tile<T, D, DV, DP, DVP, PF>(myring + (nx % S) * STAGE, kbase, vbase, a.ks[2], a.vs[2],
                                     ks0 + (w + nx * W) * kTileKeys, ks1, lane);
      cp_async_commit();
    }
    cp_async_wait<S - 1>();
    __syncwarp();
    const T* Ks = myring + (it % S) * STAGE;
    const T* Vs = Ks + kTileKeys * DP;
    const int j0 = ks0 + (w + it * W) * kTileKeys;

    // Thread (g, t) reads 8 consecutive head-dim elements [32c + 8t, +8) of Q rows g,
    // g+8 and K keys g, g+8; elements {0..3} feed the first k16 step and {4..7} the
    // second, so logical k = 2t, 2t+1, 2t+8, 2t+9 map to physical 32c + 8t + {0,1,2,3}
    // (+4), identically for A and B. PV: thread (g, t) reads dv [64c + 8g, +8) of keys 2t,
    // 2t+1, 2t+8, 2t+9; m-tile j's rows g / g+8 are dv 64c + 8g + 2j / +1, so each A
    // register is two halves of two loaded words (prmt, in tc_tile_step).
    auto qk = [&](int c, uint4& qa, uint4& qb, uint4& k0, uint4& k1) {
      const int d = 32 * c + 8 * t;
      qa = qb = k0 = k1 = make_uint4(0, 0, 0, 0);
      if (32 * c + 32 <= D || d < D) {
        qa = *reinterpret_cast<const uint4*>(Qs + g * DP + d);
        if (NT == 2) qb = *reinterpret_cast<const uint4*>(Qs + (g + 8) * DP + d);
        k0 = *reinterpret_cast<const uint4*>(Ks + g * DP + d);
        k1 = *reinterpret_cast<const uint4*>(Ks + (g + 8) * DP + d);
      }
    };
    auto key = [&](int n, int e1) { return j0 + 8 * n + 2 * t + e1; };
    auto pv = [&](int c, uint4& v0, uint4& v1, uint4& v2, uint4& v3) {
      const int dv = 64 * c + 8 * g;
      v0 = v1 = v2 = v3 = make_uint4(0, 0, 0, 0);
      if (64 * c + 64 <= DV || dv < DV) {
        v0 = *reinterpret_cast<const uint4*>(Vs + (2 * t) * DVP + dv);
        v1 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 1) * DVP + dv);
        v2 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 8) * DVP + dv);
        v3 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 9) * DVP + dv);
      }
    };
    tc_tile_step<T, D, DV, NT>(a, rowA, rowB, qk, key, pv, mA, mB, lA, lB, acc);
    __syncwarp();  // the stage is refilled next iteration
  }
  cp_async_wait<0>();

  lA += __shfl_xor_sync(0xffffffffu, lA, 1);
  lA += __shfl_xor_sync(0xffffffffu, lA, 2);
  if (NT == 2) {
    lB += __shfl_xor_sync(0xffffffffu, lB, 1);
    lB += __shfl_xor_sync(0xffffffffu, lB, 2);
  }
  __syncthreads();  // every warp is done with Q and the ring: reuse smem
  float* red = reinterpret_cast<float*>(smem);
  float* red_m = red;
  float* red_l = red + W * 16;
  float* red_o = red + 2 * W * 16;
  if (t == 0) {
    red_m[w * 16 + g] = mA;
    red_l[w * 16 + g] = lA;
    red_m[w * 16 + g + 8] = NT == 2 ? mB : -INFINITY;
    red_l[w * 16 + g + 8] = NT == 2 ? lB : 0.f;
  }
#pragma unroll
  for (int c = 0; c < NVC; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int dv = 64 * c + 8 * g + 2 * j;
      if (dv < DV) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int row = 8 * n + 2 * t;
          float* o0 = red_o + (w * 16 + row) * DV + dv;
          float* o1 = o0 + DV;
          o0[0] = acc[c][j][n][0];
          o0[1] = acc[c][j][n][2];
          o1[0] = acc[c][j][n][1];
          o1[1] = acc[c][j][n][3];
        }
      }
    }
  __syncthreads();
  block_finish<T, DV, W>(a, red, RB, b, kvh, r0, split, qlen);
}

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
  const int ntiles = (ks1 - ks0 + kTileKeys - 1) / kTileKeys;
  const int my_tiles = ntiles > w ? (ntiles - w + W - 1) / W : 0;
  const float* kbase = reinterpret_cast<const float*>(a.k) + b * a.ks[0] + kvh * a.ks[1];
  const float* vbase = reinterpret_cast<const float*>(a.v) + b * a.vs[0] + kvh * a.vs[1];
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
#pragma unroll
    for (int x = 0; x < VX; ++x)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][x][e] = 0.f;
  }

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
  if (M != -INFINITY) {
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
  store4<T>(reinterpret_cast<T*>(a.out) + out_offset(a, b, h, i) + 4 * c,
            make_float4(o.x * scale, o.y * scale, o.z * scale, o.w * scale));
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
