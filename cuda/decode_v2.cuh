// Decode v2 (DRAFT, compile-checked only, not routed by default): a persistent
// producer/consumer decode kernel for bf16/fp16, D == Dv in {64, 128, 256, 512}.
// Host side: decode_v2.cu. Design: docs/cuda_decode.md, "v2 draft (not yet run)".
//
// Work: units u = (b, kv head), each with all R = G * Lq <= 8 * NT query rows
// of the kv head. Every unit is TPU = ceil(Lk / 16) "nominal" tiles; the T = U *
// TPU nominal tiles are cut into C contiguous, equal ranges, one per CTA (C =
// SMs x occupancy, <= T), so every CTA streams the same bytes (stream-K). A CTA
// range covers segments: a tail of one unit, whole units, a head of another.
// A segment's nominal tiles [lo, hi) of TPU map proportionally to the unit's
// real tiles [lo * n / TPU, hi * n / TPU) of n = ceil((kb1 - kb0) / 16), where
// [kb0, kb1) is the union of the rows' visible ranges (kv lengths, band,
// causal): a short kv length streams only its prefix, and the segments of a
// unit still partition its real tiles exactly.
//
// Threads: NW consumer warps + 1 producer warp. A ring of NS stages, each one
// 16-key tile of K and V (rows padded in smem as in the current kernel, so the
// mma fragment loads are conflict-free), full/empty mbarriers per stage. The
// producer's 32 lanes issue one cp.async.bulk each per tile (lane = K row 0..15
// or V row 0..15; any layout whose rows are 16-byte aligned: head- and
// seq-major), completing on the stage's full barrier (expect_tx = the tile's
// bytes); V rows past the unit's keys are zero-filled by their lane (K rows
// there are never read unmasked). The producer runs up to NS tiles ahead of the
// consumers, across segment boundaries (the next unit's K/V streams while the
// consumers merge the previous one). Consumer warp w takes the CTA's tiles n
// with n % NW == w (online softmax per warp, the current kernel's mma math),
// and releases each stage on its empty barrier.
//
// Segment end: the consumer warps merge through smem (named barrier 1, the
// producer never joins). A whole unit -> out + lse directly (sinks, empty rows).
// A partial unit -> normalized partial out + log2 lse to scratch slot 2c (the
// unit is the CTA's first) or 2c + 1 (its last), then either the last CTA to
// finish the unit (atomic counter, reset by that CTA) merges all its
// segments (fused), or combine_v2_kernel does after the launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/decode_attention.cuh"

namespace jax_sdpa {
namespace cuda_decode {
namespace v2 {

// Launch-wide work description (kernel parameter, beside Args).
struct Work {
  long long T;  // nominal tiles in all: U * TPU
  int U;        // units: B * Hk
  int TPU;      // nominal tiles per unit: ceil(Lk / 16)
  int C;        // CTAs (grid), <= T
  int fused;    // 1: the last CTA of a split unit combines (a.counters), 0: combine kernel
};

constexpr int kSlotRows = 16;  // partial rows per scratch slot (>= 8 * NT)

__device__ __forceinline__ long long cta_start(const Work& w, int c) {
  return static_cast<long long>(c) * w.T / w.C;
}
// The CTA whose range holds nominal tile x: the largest c with start(c) <= x.
__device__ __forceinline__ int cta_of(const Work& w, long long x) {
  return static_cast<int>(((x + 1) * w.C - 1) / w.T);
}
// Scratch slot of CTA c's segment of unit u.
__device__ __forceinline__ int slot_of(const Work& w, int c, int u) {
  return (cta_start(w, c) / w.TPU == u) ? 2 * c : 2 * c + 1;
}

// ---- Hopper async-copy / mbarrier wrappers (sm_90) -------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra.uni DONE;\n"
      "bra.uni LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// 1-D bulk copy global -> shared (16-byte aligned, bytes % 16 == 0), completes
// `bytes` of the barrier's transaction count.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// Orders this thread's generic-proxy smem writes before later async-proxy writes.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#endif
// Barrier 1 over the consumer warps only (0 is __syncthreads).
__device__ __forceinline__ void consumer_sync(int nthreads) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(nthreads) : "memory");
}

// ---- config ----------------------------------------------------------------------
template <typename T, int D, int NT, int NW, int NS>
struct Config {
  static constexpr int kThreads = (NW + 1) * 32;
  static constexpr int RB = 8 * NT;  // query rows a CTA holds per unit
  // The current kernel's pads (cuda/decode_attention.cuh, TcConfig): K rows stride
  // 64 mod 128 bytes, V rows 16 mod 32 bytes.
  static constexpr int DP = D + ((64 - (D * 2) % 128) + 128) % 128 / 2;
  static constexpr int DVP = D + 8;
  static constexpr int kStageElems = kTileKeys * (DP + DVP);
  static constexpr size_t kStageBytes = static_cast<size_t>(kStageElems) * sizeof(T);
  static constexpr size_t kRingBytes = NS * kStageBytes;
  static constexpr size_t kQBytes = static_cast<size_t>(RB) * DP * sizeof(T);
  static constexpr size_t kRedBytes = static_cast<size_t>(NW) * RB * (2 + D) * sizeof(float);
  static constexpr size_t kBarBytes = 2 * NS * sizeof(uint64_t) + 16;
  static constexpr size_t kSmem = kRingBytes + kQBytes + kRedBytes + kBarBytes;
  static_assert(kStageBytes % 16 == 0 && kQBytes % 16 == 0 && kRedBytes % 16 == 0, "align");
};

// A segment: the CTA's part of unit u, real tiles [t0, t1) from key kb0.
struct Segment {
  int u, b, kvh;
  int kb0, kb1;  // union of the rows' visible keys
  int t0, t1;
  bool whole;    // the CTA holds the whole unit (no partials)
  int qlen, kvlen;
};

template <int RB>
__device__ __forceinline__ Segment make_segment(const Args& a, const Work& w, int u,
                                                long long lo, long long hi) {
  Segment s;
  s.u = u;
  s.kvh = u % a.Hk;
  s.b = u / a.Hk;
  s.qlen = static_cast<int>(clamp_length(a.qlen, s.b, a.Lq));
  s.kvlen = static_cast<int>(clamp_length(a.kvlen, s.b, a.Lk));
  int kb0 = INT_MAX, kb1 = 0;
  for (int r = 0; r < a.R; ++r) {
    RowInfo ri = row_info(a, s.b, s.kvh, r, s.qlen, s.kvlen);
    if (ri.last > ri.first) {
      kb0 = min(kb0, ri.first);
      kb1 = max(kb1, ri.last);
    }
  }
  if (kb1 <= kb0) kb0 = kb1 = 0;
  s.kb0 = kb0;
  s.kb1 = kb1;
  const long long n = (kb1 - kb0 + kTileKeys - 1) / kTileKeys;
  s.t0 = static_cast<int>(lo * n / w.TPU);
  s.t1 = static_cast<int>(hi * n / w.TPU);
  s.whole = lo == 0 && hi == w.TPU;
  return s;
}

// Weighted merge of unit u's partials for row rr, dv [4 c4, +4) -> out (+ lse).
template <typename T, int DV>
__device__ __forceinline__ void combine_item(const Args& a, const Work& w, int u, int rr, int c4) {
  const int kvh = u % a.Hk, b = u / a.Hk;
  const int h = kvh * a.G + rr / a.Lq, i = rr % a.Lq;
  const int qlen = static_cast<int>(clamp_length(a.qlen, b, a.Lq));
  const int64_t grow = (static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i;
  const long long x0 = static_cast<long long>(u) * w.TPU;
  const int c0 = cta_of(w, x0), c1 = cta_of(w, x0 + w.TPU - 1);
  float M = -INFINITY;
  for (int c = c0; c <= c1; ++c)
    M = fmaxf(M, __ldcg(a.part_lse + slot_of(w, c, u) * kSlotRows + rr));
  float L = 0.f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  if (M != -INFINITY) {
#pragma unroll 4
    for (int c = c0; c <= c1; ++c) {
      const int sl = slot_of(w, c, u);
      const float ls = __ldcg(a.part_lse + sl * kSlotRows + rr);
      const float4 x = __ldcg(reinterpret_cast<const float4*>(
          a.part_o + (static_cast<int64_t>(sl) * kSlotRows + rr) * DV + 4 * c4));
      const float wgt = ls == -INFINITY ? 0.f : exp2f(ls - M);
      L += wgt;
      o.x = fmaf(wgt, x.x, o.x);
      o.y = fmaf(wgt, x.y, o.y);
      o.z = fmaf(wgt, x.z, o.z);
      o.w = fmaf(wgt, x.w, o.w);
    }
  }
  finalize_write<T>(a, b, h, i, qlen, M, L, o.x, 4 * c4 + 0, grow);
  finalize_write<T>(a, b, h, i, qlen, M, L, o.y, 4 * c4 + 1, grow);
  finalize_write<T>(a, b, h, i, qlen, M, L, o.z, 4 * c4 + 2, grow);
  finalize_write<T>(a, b, h, i, qlen, M, L, o.w, 4 * c4 + 3, grow);
}

// ---- the kernel ---------------------------------------------------------------
template <typename T, int D, int NT, int NW, int NS>
__global__ void __launch_bounds__((NW + 1) * 32, 1) decode_v2_kernel(const Args a, const Work wk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Cfg = Config<T, D, NT, NW, NS>;
  constexpr int DV = D;
  constexpr int RB = Cfg::RB, DP = Cfg::DP, DVP = Cfg::DVP, STAGE = Cfg::kStageElems;
  constexpr int NKC = D / 32;  // 32-wide head-dim chunks (QK)
  constexpr int NVC = DV / 64; // 64-wide dv chunks (PV)
  constexpr int EPV = 16 / sizeof(T);
  constexpr int CT = NW * 32;  // consumer threads
  extern __shared__ __align__(128) unsigned char smem[];
  T* ring = reinterpret_cast<T*>(smem);
  T* Qs = reinterpret_cast<T*>(smem + Cfg::kRingBytes);  // [RB][DP]
  float* red = reinterpret_cast<float*>(smem + Cfg::kRingBytes + Cfg::kQBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kRingBytes + Cfg::kQBytes +
                                               Cfg::kRedBytes);
  uint64_t* empty = full + NS;
  int* s_flag = reinterpret_cast<int*>(empty + NS);

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  if (tid == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(&full[s], 32);  // the producer's 32 lanes (lane 0 with expect_tx)
      mbar_init(&empty[s], 1);  // the consuming warp's lane 0
    }
    fence_mbar_init();
  }
  __syncthreads();

  const int c = blockIdx.x;
  const long long x_begin = cta_start(wk, c), x_end = cta_start(wk, c + 1);
  const int u_first = static_cast<int>(x_begin / wk.TPU);
  const int u_last = static_cast<int>((x_end - 1) / wk.TPU);

  if (w == NW) {
    // ---------------- producer warp ----------------
    const int key = lane & 15;
    const bool isv = lane >= 16;
    uint32_t n = 0;  // the CTA's tile sequence number
    for (int u = u_first; u <= u_last; ++u) {
      const long long ux = static_cast<long long>(u) * wk.TPU;
      const long long lo = (x_begin > ux ? x_begin : ux) - ux;
      const long long hi = (x_end < ux + wk.TPU ? x_end : ux + wk.TPU) - ux;
      const Segment sg = make_segment<RB>(a, wk, u, lo, hi);
      const T* base = isv ? reinterpret_cast<const T*>(a.v) + sg.b * a.vs[0] + sg.kvh * a.vs[1]
                          : reinterpret_cast<const T*>(a.k) + sg.b * a.ks[0] + sg.kvh * a.ks[1];
      const int64_t rstride = isv ? a.vs[2] : a.ks[2];
      for (int t = sg.t0; t < sg.t1; ++t, ++n) {
        const int slot = n % NS;
        mbar_wait(&empty[slot], ((n / NS) & 1) ^ 1);
        const int j0 = sg.kb0 + t * kTileKeys;
        const int nvalid = min(kTileKeys, sg.kb1 - j0);
        if (lane == 0)
          mbar_arrive_expect_tx(&full[slot],
                                static_cast<uint32_t>(nvalid * (D + DV) * sizeof(T)));
        __syncwarp();
        T* st = ring + slot * STAGE;
        T* dst = isv ? st + kTileKeys * DP + key * DVP : st + key * DP;
        if (key < nvalid) {
          bulk_g2s(dst, base + static_cast<int64_t>(j0 + key) * rstride,
                   static_cast<uint32_t>((isv ? DV : D) * sizeof(T)), &full[slot]);
        } else if (isv) {
          // Past the unit's keys: P is 0 there, but 0 * garbage may be NaN.
#pragma unroll 4
          for (int e = 0; e < DV; e += EPV) *reinterpret_cast<uint4*>(dst + e) = make_uint4(0, 0, 0, 0);
          fence_proxy_async();  // before a later bulk copy rewrites this row
        }
        if (lane != 0) mbar_arrive(&full[slot]);
      }
    }
    return;  // consumers never sync with the producer again (named barrier 1)
  }

  // ---------------- consumer warps ----------------
  const int g = lane >> 2, t = lane & 3;
  uint32_t nbase = 0;  // sequence number of the segment's first tile
  for (int u = u_first; u <= u_last; ++u) {
    const long long ux = static_cast<long long>(u) * wk.TPU;
    const long long lo = (x_begin > ux ? x_begin : ux) - ux;
    const long long hi = (x_end < ux + wk.TPU ? x_end : ux + wk.TPU) - ux;
    const Segment sg = make_segment<RB>(a, wk, u, lo, hi);
    const int ntiles = sg.t1 - sg.t0;

    // Q rows of the unit -> smem (zeros past R). The previous segment's last
    // barrier guarantees nobody still reads Qs / red.
    {
      constexpr int QC = D / EPV;
      for (int idx = tid; idx < RB * QC; idx += CT) {
        const int rr = idx / QC, cc = idx - rr * QC;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (rr < a.R) {
          const int h = sg.kvh * a.G + rr / a.Lq, i = rr % a.Lq;
          val = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(a.q) + sg.b * a.qs[0] +
                                                h * a.qs[1] + i * a.qs[2] + cc * EPV);
        }
        *reinterpret_cast<uint4*>(Qs + rr * DP + cc * EPV) = val;
      }
    }
    consumer_sync(CT);

    const RowInfo rowA = row_info(a, sg.b, sg.kvh, g, sg.qlen, sg.kvlen);
    RowInfo rowB = rowA;
    if (NT == 2) rowB = row_info(a, sg.b, sg.kvh, g + 8, sg.qlen, sg.kvlen);

    float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
    float acc[NVC][4][NT][4];
#pragma unroll
    for (int cc = 0; cc < NVC; ++cc)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int nn = 0; nn < NT; ++nn)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[cc][j][nn][e] = 0.f;

    // This warp's first tile k of the segment: (nbase + k) % NW == w.
    const int k_first = static_cast<int>((w + NW - nbase % NW) % NW);
    for (int k = k_first; k < ntiles; k += NW) {
      const uint32_t n = nbase + k;
      const int slot = n % NS;
      mbar_wait(&full[slot], (n / NS) & 1);
      const T* Ks = ring + slot * STAGE;
      const T* Vs = Ks + kTileKeys * DP;
      const int j0 = sg.kb0 + (sg.t0 + k) * kTileKeys;

      // S = Q K^T (the current kernel's fragment scheme; two accumulator sets
      // break the dependent mma chain over the head dim).
      float s[2][2][4];
#pragma unroll
      for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int nn = 0; nn < 2; ++nn)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[p][nn][e] = 0.f;
#pragma unroll
      for (int cc = 0; cc < NKC; ++cc) {
        const int d = 32 * cc + 8 * t;
        uint4 qa, qb = make_uint4(0, 0, 0, 0);
        qa = *reinterpret_cast<const uint4*>(Qs + g * DP + d);
        if (NT == 2) qb = *reinterpret_cast<const uint4*>(Qs + (g + 8) * DP + d);
        const uint4 k0 = *reinterpret_cast<const uint4*>(Ks + g * DP + d);
        const uint4 k1 = *reinterpret_cast<const uint4*>(Ks + (g + 8) * DP + d);
        float(&s0)[4] = s[cc & 1][0];
        float(&s1)[4] = s[cc & 1][1];
        mma16816<T>(s0, qa.x, qb.x, qa.y, qb.y, k0.x, k0.y);
        mma16816<T>(s1, qa.x, qb.x, qa.y, qb.y, k1.x, k1.y);
        mma16816<T>(s0, qa.z, qb.z, qa.w, qb.w, k0.z, k0.w);
        mma16816<T>(s1, qa.z, qb.z, qa.w, qb.w, k1.z, k1.w);
      }
      float sc[2][4];
#pragma unroll
      for (int nn = 0; nn < 2; ++nn)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nn][e] = s[0][nn][e] + s[1][nn][e];

      float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
      for (int nn = 0; nn < 2; ++nn)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = j0 + 8 * nn + 2 * t + (e & 1);
          const bool upper = e >= 2;
          if (upper && NT == 1) {
            sc[nn][e] = -INFINITY;
            continue;
          }
          const int first = upper ? rowB.first : rowA.first;
          const int last = upper ? rowB.last : rowA.last;
          const int64_t mrow = upper ? rowB.mrow : rowA.mrow;
          sc[nn][e] = masked_score(a, sc[nn][e] * a.scale_log2, j, first, last, mrow);
          if (upper)
            mxB = fmaxf(mxB, sc[nn][e]);
          else
            mxA = fmaxf(mxA, sc[nn][e]);
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
      for (int nn = 0; nn < 2; ++nn) {
        sc[nn][0] = exp2f(sc[nn][0] - muA);
        sc[nn][1] = exp2f(sc[nn][1] - muA);
        sumA += sc[nn][0] + sc[nn][1];
        if (NT == 2) {
          sc[nn][2] = exp2f(sc[nn][2] - muB);
          sc[nn][3] = exp2f(sc[nn][3] - muB);
          sumB += sc[nn][2] + sc[nn][3];
        }
      }
      lA = lA * alA + sumA;
      if (NT == 2) lB = lB * alB + sumB;
      {
        const float a0 = __shfl_sync(0xffffffffu, alA, (2 * t) * 4);
        const float a1 = __shfl_sync(0xffffffffu, alA, (2 * t + 1) * 4);
        float b0 = 1.f, b1 = 1.f;
        if (NT == 2) {
          b0 = __shfl_sync(0xffffffffu, alB, (2 * t) * 4);
          b1 = __shfl_sync(0xffffffffu, alB, (2 * t + 1) * 4);
        }
#pragma unroll
        for (int cc = 0; cc < NVC; ++cc)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc[cc][j][0][0] *= a0;
            acc[cc][j][0][1] *= a1;
            acc[cc][j][0][2] *= a0;
            acc[cc][j][0][3] *= a1;
            if (NT == 2) {
              acc[cc][j][NT - 1][0] *= b0;
              acc[cc][j][NT - 1][1] *= b1;
              acc[cc][j][NT - 1][2] *= b0;
              acc[cc][j][NT - 1][3] *= b1;
            }
          }
      }
      uint32_t pb[NT][2];
      pb[0][0] = pack2<T>(sc[0][0], sc[0][1]);
      pb[0][1] = pack2<T>(sc[1][0], sc[1][1]);
      if (NT == 2) {
        pb[NT - 1][0] = pack2<T>(sc[0][2], sc[0][3]);
        pb[NT - 1][1] = pack2<T>(sc[1][2], sc[1][3]);
      }
      // O^T += V^T P^T (the current kernel's V fragment scheme).
#pragma unroll
      for (int cc = 0; cc < NVC; ++cc) {
        const int dv = 64 * cc + 8 * g;
        const uint4 v0 = *reinterpret_cast<const uint4*>(Vs + (2 * t) * DVP + dv);
        const uint4 v1 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 1) * DVP + dv);
        const uint4 v2 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 8) * DVP + dv);
        const uint4 v3 = *reinterpret_cast<const uint4*>(Vs + (2 * t + 9) * DVP + dv);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t x0 = u4get(v0, j), x1 = u4get(v1, j), x2 = u4get(v2, j),
                         x3 = u4get(v3, j);
          const uint32_t A0 = prmt(x0, x1, 0x5410), A1 = prmt(x0, x1, 0x7632);
          const uint32_t A2 = prmt(x2, x3, 0x5410), A3 = prmt(x2, x3, 0x7632);
#pragma unroll
          for (int nn = 0; nn < NT; ++nn)
            mma16816<T>(acc[cc][j][nn], A0, A1, A2, A3, pb[nn][0], pb[nn][1]);
        }
      }
      __syncwarp();  // every lane's smem reads are in registers
      if (lane == 0) mbar_arrive(&empty[slot]);
    }
    nbase += ntiles;

    // ---- merge the warps, write out or a partial ----
    lA += __shfl_xor_sync(0xffffffffu, lA, 1);
    lA += __shfl_xor_sync(0xffffffffu, lA, 2);
    if (NT == 2) {
      lB += __shfl_xor_sync(0xffffffffu, lB, 1);
      lB += __shfl_xor_sync(0xffffffffu, lB, 2);
    }
    float* red_m = red;
    float* red_l = red + NW * RB;
    float* red_o = red + 2 * NW * RB;
    if (t == 0) {
      red_m[w * RB + g] = mA;
      red_l[w * RB + g] = lA;
      if (NT == 2) {
        red_m[w * RB + g + 8] = mB;
        red_l[w * RB + g + 8] = lB;
      }
    }
#pragma unroll
    for (int cc = 0; cc < NVC; ++cc)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int dv = 64 * cc + 8 * g + 2 * j;
#pragma unroll
        for (int nn = 0; nn < NT; ++nn) {
          const int row = 8 * nn + 2 * t;
          float* o0 = red_o + (w * RB + row) * DV + dv;
          float* o1 = o0 + DV;
          o0[0] = acc[cc][j][nn][0];
          o0[1] = acc[cc][j][nn][2];
          o1[0] = acc[cc][j][nn][1];
          o1[1] = acc[cc][j][nn][3];
        }
      }
    consumer_sync(CT);
    const int R = a.R;
    for (int idx = tid; idx < R * DV; idx += CT) {
      const int rr = idx / DV, dv = idx - rr * DV;
      const int h = sg.kvh * a.G + rr / a.Lq, i = rr % a.Lq;
      float M = -INFINITY;
#pragma unroll
      for (int ww = 0; ww < NW; ++ww) M = fmaxf(M, red_m[ww * RB + rr]);
      float L = 0.f, o = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int ww = 0; ww < NW; ++ww) {
          const float mw = red_m[ww * RB + rr];
          if (mw == -INFINITY) continue;
          const float f = exp2f(mw - M);
          L += f * red_l[ww * RB + rr];
          o += f * red_o[(ww * RB + rr) * DV + dv];
        }
      }
      const int64_t grow = (static_cast<int64_t>(sg.b) * a.Hq + h) * a.Lq + i;
      if (sg.whole) {
        finalize_write<T>(a, sg.b, h, i, sg.qlen, M, L, o, dv, grow);
      } else {
        const int64_t pr = static_cast<int64_t>(slot_of(wk, c, u)) * kSlotRows + rr;
        a.part_o[pr * DV + dv] = L > 0.f ? __fdividef(o, L) : 0.f;
        if (dv == 0) a.part_lse[pr] = L > 0.f ? M + log2f(L) : -INFINITY;
      }
    }
    if (!sg.whole && wk.fused) {
      // Release: partials, fence, count; acquire: count, fence, L2 reads (__ldcg).
      __threadfence();
      consumer_sync(CT);
      if (tid == 0) {
        const long long ux0 = static_cast<long long>(u) * wk.TPU;
        const int nseg = cta_of(wk, ux0 + wk.TPU - 1) - cta_of(wk, ux0) + 1;
        const int prev = atomicAdd(&a.counters[u], 1);
        *s_flag = prev == nseg - 1;
      }
      consumer_sync(CT);
      if (*s_flag) {
        __threadfence();
        constexpr int DV4 = DV / 4;
        for (int idx = tid; idx < R * DV4; idx += CT)
          combine_item<T, DV>(a, wk, u, idx / DV4, idx % DV4);
        if (tid == 0) a.counters[u] = 0;  // ready for the next launch
      }
    }
    consumer_sync(CT);  // red, Qs and s_flag are reused by the next segment
  }
#endif  // __CUDA_ARCH__ >= 900
}

// Separate combine: one thread per (unit, row, 4 dv) of the units that were split.
template <typename T, int DV>
__global__ void __launch_bounds__(128) combine_v2_kernel(const Args a, const Work wk) {
  constexpr int DV4 = DV / 4;
  const long long item = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long per_unit = static_cast<long long>(a.R) * DV4;
  if (item >= per_unit * wk.U) return;
  const int u = static_cast<int>(item / per_unit);
  const int rem = static_cast<int>(item - u * per_unit);
  const long long ux = static_cast<long long>(u) * wk.TPU;
  if (cta_of(wk, ux) == cta_of(wk, ux + wk.TPU - 1)) return;  // one CTA wrote it whole
  combine_item<T, DV>(a, wk, u, rem / DV4, rem % DV4);
}

}  // namespace v2
}  // namespace cuda_decode
}  // namespace jax_sdpa
