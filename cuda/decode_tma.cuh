// Decode kernel fed by TMA (sm_90+; bf16 / fp16, D = Dv in {64, 128}).
//
// Why: decode_tc_kernel's warps each issue their own 16-byte cp.async copies; on the
// H200 it streams at 73% of DRAM peak where cuDNN reaches 85% (docs/cuda_decode.md).
// Here one producer thread moves whole K / V tiles with one TMA copy each (a 5-D
// tensor map: 64 elements x D/64 chunks x kv head x key x batch, dims ordered by
// stride) into an S-deep ring of block-wide stages, so many bytes are in flight at
// almost no instruction cost. A stage holds TK = 16 W keys; consumer warp w takes
// the w-th 16-key tile of every stage and runs decode_tc_kernel's math on it (mma
// m16n8k16, online softmax per row in the log2 domain), then releases the stage.
// The warps are merged by block_finish as in decode_tc_kernel (splits, combine).
//
// Shared-memory tiles are written with the 128-byte swizzle (16-byte chunk c of
// 128-byte line L lands at chunk c ^ (L % 8)), so the fragment loads read
// swizzled addresses. Two free permutations keep every 16-byte fragment load
// conflict-free (checked by enumeration): the order of the head dims inside the
// QK loop (qk_chunk, the same for Q and K) and which smem row feeds each mma key
// index (key_row, the same for the QK n index, the PV k index and the masks).
#pragma once

#include "cuda/decode_attention.cuh"
#include "cuda/tma_helpers.cuh"

namespace jax_sdpa {
namespace cuda_decode {

using cuda_common::fence_proxy_async_smem;
using cuda_common::mbar_arrive;
using cuda_common::mbar_arrive_expect_tx;
using cuda_common::mbar_init;
using cuda_common::mbar_init_fence;
using cuda_common::mbar_wait;
using cuda_common::tma_load_5d;

// The K and V tensor maps of a call (host: encode_kv_maps) and which of
// (kv head, key, batch) the maps' dims 2, 3, 4 are.
struct TmaMaps {
  CUtensorMap k, v;
  int order[3];
};

template <typename T, int D, int DV, int NT, int W, int S>
struct TmaConfig {
  static_assert((D == 64 || D == 128) && (DV == 64 || DV == 128), "TMA decode: D, Dv in {64, 128}");
  static_assert(S >= 2, "TMA decode: the ring needs a stage in flight");
  static constexpr int kKeys = kTileKeys * W;  // keys a stage
  static constexpr int kThreads = (W + 1) * 32;  // + the producer warp
  static constexpr size_t kKBytes = static_cast<size_t>(kKeys) * D * sizeof(T);
  static constexpr size_t kVBytes = static_cast<size_t>(kKeys) * DV * sizeof(T);
  static constexpr size_t kStageBytes = kKBytes + kVBytes;  // whole 1024-byte swizzle atoms
  static constexpr size_t kRingBytes = S * kStageBytes;
  static constexpr size_t kRedBytes = static_cast<size_t>(W) * 16 * (2 + DV) * sizeof(float);
  static constexpr size_t kQOff = kRingBytes > kRedBytes ? kRingBytes : kRedBytes;
  static constexpr size_t kQBytes = 16 * D * sizeof(T);
  static constexpr size_t kBarOff = kQOff + kQBytes;
  static constexpr size_t kSmem = kBarOff + 2 * S * sizeof(uint64_t) + 1024;  // + alignment slack
};

// Byte offset of 16-byte chunk c of row `row` in a swizzled tile of LPR 128-byte lines a row.
template <int LPR>
__device__ __forceinline__ uint32_t swizzled(int row, int c) {
  const int line = row * LPR + (c >> 3);
  return static_cast<uint32_t>(line * 128 + (((c & 7) ^ (line & 7)) << 4));
}
// The 16-byte head-dim chunk thread t reads in QK step c (32 dims a step), for Q and K.
template <int D>
__device__ __forceinline__ int qk_chunk(int c, int t) {
  if constexpr (D == 128) return (c & 1) * 2 + (c >> 1) * 8 + (t & 1) + (t >> 1) * 4;
  return 4 * c + t;
}
// The 16-byte dv chunk thread row g reads in PV step c (64 dv a step); its dv are 8x that.
template <int DV>
__device__ __forceinline__ int pv_chunk(int c, int g) {
  if constexpr (DV == 128) return 8 * c + g;
  return (g >> 1) | ((g & 1) << 2);
}
// The smem row (key j0 + row) behind mma key index k = 8a + 2t + b of a 16-key tile.
__device__ __forceinline__ int key_row(int k) {
  const int a = k >> 3, t = (k >> 1) & 3, b = k & 1;
  return 4 * (2 * a + b) + (t ^ b);
}

template <typename T, int D, int DV, int NT, int W, int S>
__global__ void __launch_bounds__((W + 1) * 32, 1)
    decode_tma_kernel(const Args a, const __grid_constant__ TmaMaps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Cfg = TmaConfig<T, D, DV, NT, W, S>;
  constexpr int RB = NT * 8, TK = Cfg::kKeys;
  constexpr int NKC = D / 32, NVC = DV / 64;
  constexpr int EPV = 16 / sizeof(T);
  constexpr int KLPR = D / 64, VLPR = DV / 64;  // 128-byte lines a K / V row
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  unsigned char* ring = smem;
  T* Qs = reinterpret_cast<T*>(smem + Cfg::kQOff);  // [16][D], plain rows
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff);
  uint64_t* empty = full + S;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rc = blockIdx.x % a.row_chunks;
  const int bk = blockIdx.x / a.row_chunks;
  const int kvh = bk % a.Hk, b = bk / a.Hk;
  const int split = blockIdx.y;
  const int qlen = static_cast<int>(clamp_length(a.qlen, b, a.Lq));
  const int kvlen = static_cast<int>(clamp_length(a.kvlen, b, a.Lk));
  const int r0 = rc * RB;

  int ks0, ks1;
  split_range<TK>(a, b, kvh, r0, RB, split, qlen, kvlen, &ks0, &ks1);
  const int nst = (ks1 - ks0 + TK - 1) / TK;  // stages: every split but the last is whole ones

  if (tid == W * 32) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], W);
    }
    mbar_init_fence();
  }
  if (w < W) {  // Q rows of the block -> smem (zeros past the group / chunk)
    constexpr int QC = D / EPV;
    for (int idx = tid; idx < 16 * QC; idx += W * 32) {
      const int rr = idx / QC, c = idx - rr * QC;
      const int r = r0 + rr;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (rr < RB && r < a.R) {
        const int h = kvh * a.G + r / a.Lq, i = r % a.Lq;
        val = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(a.q) + b * a.qs[0] +
                                              h * a.qs[1] + i * a.qs[2] + c * EPV);
      }
      *reinterpret_cast<uint4*>(Qs + rr * D + c * EPV) = val;
    }
  }
  __syncthreads();

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

  if (w == W) {
    // Producer: one thread keeps the ring full (a stage is refilled once all W
    // consumers have released it).
    if (lane == 0) {
      for (int it = 0; it < nst; ++it) {
        const int s = it % S;
        if (it >= S) mbar_wait(&empty[s], ((it / S) - 1) & 1);
        mbar_arrive_expect_tx(&full[s], static_cast<uint32_t>(Cfg::kStageBytes));
        const int key = ks0 + it * TK;
        // Coordinate of tensor dim 2 + i: (kv head, key, batch)[order[i]] (selects, not an
        // indexed local array: that would live on the stack).
        auto pick = [&](int o) { return o == 0 ? kvh : (o == 1 ? key : b); };
        const int c2 = pick(maps.order[0]), c3 = pick(maps.order[1]), c4 = pick(maps.order[2]);
        unsigned char* st = ring + s * Cfg::kStageBytes;
        tma_load_5d(st, &maps.k, &full[s], 0, 0, c2, c3, c4);
        tma_load_5d(st + Cfg::kKBytes, &maps.v, &full[s], 0, 0, c2, c3, c4);
      }
    }
  } else {
    // Consumer warp w: the w-th 16-key tile of every stage.
    const RowInfo rowA = row_info(a, b, kvh, r0 + g, qlen, kvlen);
    RowInfo rowB = rowA;
    if (NT == 2) rowB = row_info(a, b, kvh, r0 + g + 8, qlen, kvlen);
    uint4 qa[NKC], qb[NKC];  // Q fragments, held for the whole key loop
#pragma unroll
    for (int c = 0; c < NKC; ++c) {
      const int d = qk_chunk<D>(c, t) * EPV;
      qa[c] = *reinterpret_cast<const uint4*>(Qs + g * D + d);
      qb[c] = NT == 2 ? *reinterpret_cast<const uint4*>(Qs + (g + 8) * D + d) : make_uint4(0, 0, 0, 0);
    }
    const int krow0 = key_row(g), krow1 = key_row(g + 8);
    const int vrow0 = key_row(2 * t), vrow1 = key_row(2 * t + 1);
    const int vrow2 = key_row(2 * t + 8), vrow3 = key_row(2 * t + 9);
    // Keys of this thread's score elements s[n][e] (n-tile n, e & 1), as smem rows.
    int srow[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) srow[n][e] = key_row(8 * n + 2 * t + e);

    for (int it = 0; it < nst; ++it) {
      const int s = it % S;
      mbar_wait(&full[s], (it / S) & 1);
      const int j0 = ks0 + it * TK + kTileKeys * w;
      const unsigned char* Kt = ring + s * Cfg::kStageBytes + w * kTileKeys * D * sizeof(T);
      unsigned char* Vt =
          ring + s * Cfg::kStageBytes + Cfg::kKBytes + w * kTileKeys * DV * sizeof(T);
      if (j0 < ks1) {
        if (j0 + kTileKeys > ks1) {
          // Keys past the union of the rows' ranges: their scores are masked, but a
          // fixed-size cache may hold NaN / inf there and 0 * NaN is NaN: zero V's rows
          // (whole rows: the swizzle only moves chunks within a row's lines).
          constexpr int RC = DV * sizeof(T) / 16;  // 16-byte chunks a row
          for (int idx = lane; idx < kTileKeys * RC; idx += 32) {
            const int row = idx / RC;
            if (j0 + row >= ks1)
              *reinterpret_cast<uint4*>(Vt + idx * 16) = make_uint4(0, 0, 0, 0);
          }
          fence_proxy_async_smem();  // before TMA refills this stage
          __syncwarp();
        }

        // S = Q K^T (decode_tc_kernel's math; swizzled, permuted fragment addresses).
        float sc[2][4], sc_odd[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[n][e] = sc_odd[n][e] = 0.f;
#pragma unroll
        for (int c = 0; c < NKC; ++c) {
          float(&acc_s)[2][4] = (c & 1) ? sc_odd : sc;
          const int f = qk_chunk<D>(c, t);
          const uint4 k0 = *reinterpret_cast<const uint4*>(Kt + swizzled<KLPR>(krow0, f));
          const uint4 k1 = *reinterpret_cast<const uint4*>(Kt + swizzled<KLPR>(krow1, f));
          const uint4 q0 = qa[c], q1 = qb[c];
          mma16816<T>(acc_s[0], q0.x, q1.x, q0.y, q1.y, k0.x, k0.y);
          mma16816<T>(acc_s[1], q0.x, q1.x, q0.y, q1.y, k1.x, k1.y);
          mma16816<T>(acc_s[0], q0.z, q1.z, q0.w, q1.w, k0.z, k0.w);
          mma16816<T>(acc_s[1], q0.z, q1.z, q0.w, q1.w, k1.z, k1.w);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[n][e] += sc_odd[n][e];

        // sc[n][e]: row g (e < 2) or g + 8, key j0 + srow[n][e & 1].
        float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = j0 + srow[n][e & 1];
            const bool upper = e >= 2;
            if (upper && NT == 1) {
              sc[n][e] = -INFINITY;
              continue;
            }
            const int first = upper ? rowB.first : rowA.first;
            const int last = upper ? rowB.last : rowA.last;
            const int64_t mrow = upper ? rowB.mrow : rowA.mrow;
            sc[n][e] = masked_score(a, sc[n][e] * a.scale_log2, j, first, last, mrow);
            if (upper)
              mxB = fmaxf(mxB, sc[n][e]);
            else
              mxA = fmaxf(mxA, sc[n][e]);
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
          sc[n][0] = exp2f(sc[n][0] - muA);
          sc[n][1] = exp2f(sc[n][1] - muA);
          sumA += sc[n][0] + sc[n][1];
          if (NT == 2) {
            sc[n][2] = exp2f(sc[n][2] - muB);
            sc[n][3] = exp2f(sc[n][3] - muB);
            sumB += sc[n][2] + sc[n][3];
          }
        }
        lA = lA * alA + sumA;
        if (NT == 2) lB = lB * alB + sumB;

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

        uint32_t pb[NT][2];
        pb[0][0] = pack2<T>(sc[0][0], sc[0][1]);
        pb[0][1] = pack2<T>(sc[1][0], sc[1][1]);
        if (NT == 2) {
          pb[NT - 1][0] = pack2<T>(sc[0][2], sc[0][3]);
          pb[NT - 1][1] = pack2<T>(sc[1][2], sc[1][3]);
        }

        // O^T += V^T P^T: thread (g, t) reads dv chunk pv_chunk(c, g) of the rows behind
        // keys 2t, 2t+1, 2t+8, 2t+9; m-tile j's rows g / g+8 are dv 8 pv_chunk + 2j / +1.
#pragma unroll
        for (int c = 0; c < NVC; ++c) {
          const int h = pv_chunk<DV>(c, g);
          const uint4 v0 = *reinterpret_cast<const uint4*>(Vt + swizzled<VLPR>(vrow0, h));
          const uint4 v1 = *reinterpret_cast<const uint4*>(Vt + swizzled<VLPR>(vrow1, h));
          const uint4 v2 = *reinterpret_cast<const uint4*>(Vt + swizzled<VLPR>(vrow2, h));
          const uint4 v3 = *reinterpret_cast<const uint4*>(Vt + swizzled<VLPR>(vrow3, h));
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t x0 = u4get(v0, j), x1 = u4get(v1, j), x2 = u4get(v2, j),
                           x3 = u4get(v3, j);
            const uint32_t A0 = prmt(x0, x1, 0x5410), A1 = prmt(x0, x1, 0x7632);
            const uint32_t A2 = prmt(x2, x3, 0x5410), A3 = prmt(x2, x3, 0x7632);
#pragma unroll
            for (int n = 0; n < NT; ++n)
              mma16816<T>(acc[c][j][n], A0, A1, A2, A3, pb[n][0], pb[n][1]);
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);  // the stage may be refilled
    }
    lA += __shfl_xor_sync(0xffffffffu, lA, 1);
    lA += __shfl_xor_sync(0xffffffffu, lA, 2);
    if (NT == 2) {
      lB += __shfl_xor_sync(0xffffffffu, lB, 1);
      lB += __shfl_xor_sync(0xffffffffu, lB, 2);
    }
  }
  __syncthreads();  // every stage was consumed (so every TMA copy landed): reuse the ring
  float* red = reinterpret_cast<float*>(ring);
  if (w < W) {
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
        const int dv = 8 * pv_chunk<DV>(c, g) + 2 * j;
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
  block_finish<T, DV, W, 1>(a, red, RB, b, kvh, r0, split, qlen);
#else
  __trap();  // sm_90+ only: the host never selects it below (decode_attention.cu)
#endif
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
