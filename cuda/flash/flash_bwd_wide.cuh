// Fast fp16/bf16 flash-attention backward for head dims in (256, 512] (zero-padded to 512),
// FlashAttention-2 style.
//
// Grid (key_tiles = ceil(Lk / 32), Hk, B); a block = 8 warps owning kBc = 32 keys of kv head
// hk. Warp w: key group kg = w >> 2 (16 keys), column quarter cq = w & 3 (128 columns of D and
// of Dv). dK and dV for (16 keys x 128 columns) stay in registers for the whole block (2 x 64
// fp32 a lane): each element has one owner, no atomics. K and V (32 x 512) stay in shared
// memory. The block loops over the G query heads of its group and the query tiles (kBr = 32
// queries) whose band reaches its keys (i_lo / i_hi as in flash_bwd_tc.cuh), rotated by the
// key tile so that concurrent blocks add into different dq rows. Per query tile (Q, dO, lse,
// delta double-buffered with cp.async):
//   1. S^T partial = K[kg keys, cq cols] Q[:, cq cols]^T (16 x 32, fp32) -> sX[warp]; barrier;
//      each warp sums the 4 partials of its key group from sX in the fixed order cq = 0..3
//      (the same operations on the same values in the 4 warps: bitwise identical S^T);
//      barrier; same for dP^T = V dO^T through the same sX (one 16 KB exchange buffer keeps
//      the double-buffered Q/dO tiles inside 227 KB).
//   2. P^T = exp2(S^T * scale * log2e - lse * log2e) (0 where invisible / lse = -inf),
//      dS^T = P^T (dP^T - delta); both packed to 16 bits as A fragments (the m16n8k16 C
//      layout of two adjacent n8 tiles is the A layout). Warp cq also writes query tile cq of
//      its group's dS (16-bit, [query][key]) to sdS.
//   3. dV[kg, cq] += P^T dO[:, cq], dK[kg, cq] += dS^T Q[:, cq] (B fragments by ldmatrix.trans).
//   4. barrier; warp w computes dQ[32 queries, 64 columns w*64..] = dS[32 x 32 keys] K[32 keys,
//      cols] and adds it into the fp32 accumulator dq_accum [B, Hq, Lq, D] with float2
//      atomics (2 key groups summed in the block first: one add per element per key tile).
// A final kernel writes dq = dq_accum * scale (16-bit, dq's strides); dK is scaled at the end.
//
// Barrier hazards (per tile: B1 top, B2 S partials visible, B3 S partials consumed, B4 dP
// partials visible, B5 sdS visible):
//   sX: S writes (after B1) vs the previous tile's dP reads (before its B5); S reads (B2..B3)
//       vs dP writes (after B3); dP reads (after B4) vs the next tile's S writes (after B1').
//   sdS: writes (B4..B5) vs the previous tile's dQ reads (after its B5, before B1).
//   Q/dO/lse/delta stage s: read in tile it (before B5); refilled by the prefetch issued
//       after B1 of tile it + 1.
//
// mma.sync m16n8k16 fragments (g = lane / 4, t = lane % 4):
//   A a0=(g, 2t..2t+1) a1=(g+8, 2t..) a2=(g, 2t+8..) a3=(g+8, 2t+8..); B b0=(k=2t..2t+1, n=g)
//   b1=(k=2t+8.., n=g); C c0,c1=(g, 2t..2t+1) c2,c3=(g+8, 2t..2t+1).
// ldmatrix.x4: lane supplies row (lane & 7) of matrix (lane >> 3); non-trans gives each thread
// row g, elements 2t, 2t+1 of each 8x8 matrix; .trans gives rows 2t, 2t+1 at column g.
// Shared rows of 512 + 8 halves (1040 bytes: 4 banks apart, ldmatrix conflict-free).
#pragma once

#include "cuda/flash/flash_attention.cuh"

namespace jax_sdpa {
namespace cuda_flash {
namespace bwd_wide {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBc = 32;          // keys per block (2 key groups of 16)
constexpr int kBr = 32;          // queries per tile
constexpr int kD = 512;          // padded head dim (D and Dv)
constexpr int kQuarter = kD / 4; // columns per warp
constexpr int kStride = kD + 8;  // elements per shared row of K, V, Q, dO
constexpr int kSdS = kBc + 8;    // elements per shared row of dS ([query][key], 80 bytes)
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory (bytes).
constexpr int kTileBytes = kBc * kStride * 2;  // 32 rows x 1040 bytes (kBr == kBc)
static_assert(kBr == kBc, "tile byte count shared by K/V and Q/dO tiles");
constexpr int kOffK = 0;
constexpr int kOffV = kOffK + kTileBytes;
constexpr int kOffQ = kOffV + kTileBytes;       // 2 stages
constexpr int kOffO = kOffQ + 2 * kTileBytes;   // 2 stages
constexpr int kOffX = kOffO + 2 * kTileBytes;   // fp32 partials [kWarps][4 n][32 lanes][4]
constexpr int kOffdS = kOffX + kWarps * 512 * 4;
constexpr int kOffL = kOffdS + kBr * kSdS * 2;  // lse (2 stages)
constexpr int kOffDl = kOffL + 2 * kBr * 4;     // delta (2 stages)
constexpr int kSmemBytes = kOffDl + 2 * kBr * 4;
static_assert(kOffX % 16 == 0 && kOffdS % 16 == 0 && kOffL % 16 == 0 && kOffDl % 16 == 0,
              "16-byte aligned regions");
static_assert(kSmemBytes <= 227 * 1024, "fits sm_90's opt-in shared memory");

struct Args {
  FwdArgs f;  // q, k, v, shapes, strides, masking, scale (f.out / f.lse unused)
  const void* out;
  const void* dout;
  const float* lse;
  const float* delta;
  float* dq_accum;  // [B, Hq, Lq, D] fp32, zeroed
  void* dk;
  void* dv;
  float scale_log2;  // scale * log2(e)
};

// 32 rows x kD elements from global (row stride gstride) into shared rows of kStride;
// rows >= valid_rows and columns >= valid_cols (a multiple of 8) are zero-filled.
template <typename T>
__device__ __forceinline__ void load_rows(T* s, const T* g, int64_t gstride, int valid_rows,
                                          int valid_cols) {
  constexpr int kVec = kD * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per row
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  constexpr int kTotal = kBc * kVec;
  static_assert(kTotal % kThreads == 0, "chunks divide the block");
#pragma unroll
  for (int it = 0; it < kTotal / kThreads; ++it) {
    const int x = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = x / kVec;
    const int c = (x % kVec) * kPer;
    const bool ok = r < valid_rows && c < valid_cols;
    cp_async16(s + r * kStride + c, ok ? g + r * gstride + c : g, ok);
  }
}

// acc[n] (16 rows of A x queries n*8..n*8+7) += A[16 rows, 128 cols] B[32 rows, 128 cols]^T.
// A and B are the shared addresses (bytes) of (row 0, first column) of the warp's slices.
template <typename T>
__device__ __forceinline__ void partial_abT(float (&acc)[kBr / 8][4], uint32_t A, uint32_t B,
                                            int lane) {
  const int lrow = lane & 7, lmat = lane >> 3;
  // A: matrices (rows 0-7 | 8-15) x (cols k | k + 8) = a0, a1, a2, a3.
  const uint32_t ap = A + ((lrow + (lmat & 1) * 8) * kStride + (lmat >> 1) * 8) * 2;
  // B (non-trans, rows = n): (n 0-7, k) = b0, (n 0-7, k + 8) = b1, then n 8-15.
  const uint32_t bp = B + ((lrow + (lmat >> 1) * 8) * kStride + (lmat & 1) * 8) * 2;
#pragma unroll
  for (int kk = 0; kk < kQuarter; kk += 16) {
    uint32_t af[4];
    ldmatrix_x4_ordered(af, ap + kk * 2);
#pragma unroll
    for (int n2 = 0; n2 < kBr / 16; ++n2) {
      uint32_t bf[4];
      ldmatrix_x4_ordered(bf, bp + (n2 * 16 * kStride + kk) * 2);
      mma16816<T>(acc[2 * n2], af, bf[0], bf[1]);
      mma16816<T>(acc[2 * n2 + 1], af, bf[2], bf[3]);
    }
  }
}

// acc[n] (16 rows x cols n*8..) += A (registers, 16 x kBr, k-steps of 16) B[kBr rows, 128 cols]
// with B stored row-major [k][n] in shared memory (ldmatrix.trans).
template <typename T>
__device__ __forceinline__ void acc_aB(float (&acc)[kQuarter / 8][4],
                                       const uint32_t (&af)[kBr / 16][4], uint32_t B, int lane) {
  const int lrow = lane & 7, lmat = lane >> 3;
  // trans: (k 0-7, n 0-7) = b0, (k 8-15, n 0-7) = b1, (k 0-7, n 8-15), (k 8-15, n 8-15).
  const uint32_t bp = B + ((lrow + (lmat & 1) * 8) * kStride + (lmat >> 1) * 8) * 2;
#pragma unroll
  for (int ks = 0; ks < kBr / 16; ++ks) {
#pragma unroll
    for (int n2 = 0; n2 < kQuarter / 16; ++n2) {
      uint32_t bf[4];
      ldmatrix_x4_trans_ordered(bf, bp + (ks * 16 * kStride + n2 * 16) * 2);
      mma16816<T>(acc[2 * n2], af[ks], bf[0], bf[1]);
      mma16816<T>(acc[2 * n2 + 1], af[ks], bf[2], bf[3]);
    }
  }
}

__device__ __forceinline__ void store_partial(float* x, const float (&v)[kBr / 8][4], int lane) {
#pragma unroll
  for (int n = 0; n < kBr / 8; ++n)
    *reinterpret_cast<float4*>(x + n * 128 + lane * 4) = make_float4(v[n][0], v[n][1], v[n][2], v[n][3]);
}

// v = ((p0 + p1) + p2) + p3 of the 4 partials starting at x (512 floats apart): the same
// operations in the same order in the 4 warps of a key group.
__device__ __forceinline__ void sum_partials(float (&v)[kBr / 8][4], const float* x, int lane) {
#pragma unroll
  for (int n = 0; n < kBr / 8; ++n) {
    const float4 p0 = *reinterpret_cast<const float4*>(x + n * 128 + lane * 4);
    v[n][0] = p0.x;
    v[n][1] = p0.y;
    v[n][2] = p0.z;
    v[n][3] = p0.w;
  }
#pragma unroll
  for (int c = 1; c < 4; ++c) {
#pragma unroll
    for (int n = 0; n < kBr / 8; ++n) {
      const float4 pc = *reinterpret_cast<const float4*>(x + c * 512 + n * 128 + lane * 4);
      v[n][0] += pc.x;
      v[n][1] += pc.y;
      v[n][2] += pc.z;
      v[n][3] += pc.w;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) flash_bwd_wide_kernel(const Args a) {
  extern __shared__ __align__(16) char smem_bw[];
  T* sK = reinterpret_cast<T*>(smem_bw + kOffK);
  T* sV = reinterpret_cast<T*>(smem_bw + kOffV);
  T* sQ = reinterpret_cast<T*>(smem_bw + kOffQ);
  T* sO = reinterpret_cast<T*>(smem_bw + kOffO);
  float* sX = reinterpret_cast<float*>(smem_bw + kOffX);
  T* sdS = reinterpret_cast<T*>(smem_bw + kOffdS);
  float* sL = reinterpret_cast<float*>(smem_bw + kOffL);
  float* sDl = reinterpret_cast<float*>(smem_bw + kOffDl);

  const FwdArgs& f = a.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int kg = warp >> 2, cq = warp & 3;
  const int lrow = lane & 7, lmat = lane >> 3;
  const int key_tile = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const KeyBlock blk = key_block<kBc, kBr>(f, key_tile, b);
  const int k0 = blk.k0, kvalid = blk.kvalid, qlen = blk.len.qlen, kvlen = blk.len.kvlen;
  const int64_t offset = blk.len.offset;
  const int qb_lo = blk.qb_lo, n_qt = blk.n_qt, n_iter = blk.n_iter;

  constexpr int kNT = kQuarter / 8;  // 16 n8 tiles of this warp's dK / dV columns
  float dk[kNT][4], dv[kNT][4];
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

  if (n_iter > 0) {
    const T* Kg = head_row<T>(f.k, f.ks, b, hk, k0);
    const T* Vg = head_row<T>(f.v, f.vs, b, hk, k0);
    load_rows<T>(sK, Kg, f.ks[2], kvalid, f.D);
    load_rows<T>(sV, Vg, f.vs[2], kvalid, f.Dv);

    const int rot = key_tile % n_iter;
    auto tile_of = [&](int it, int& h, int& qb) {
      rotated_visit<kBr>(it, rot, n_iter, n_qt, qb_lo, hk * f.G, h, qb);
    };
    auto issue = [&](int it, int stage) {
      int h, qb;
      tile_of(it, h, qb);
      const int rows = qlen - qb;  // rows >= qlen are zero-filled (qb < qlen here)
      const T* Qg = head_row<T>(f.q, f.qs, b, h, qb);
      const T* Og = head_row<T>(a.dout, f.os, b, h, qb);
      load_rows<T>(sQ + stage * kBr * kStride, Qg, f.qs[2], rows, f.D);
      load_rows<T>(sO + stage * kBr * kStride, Og, f.os[2], rows, f.Dv);
      const int64_t row0 = (static_cast<int64_t>(b) * f.Hq + h) * f.Lq + qb;
      load_row_stats<kBr>(sL + stage * kBr, sDl + stage * kBr, a.lse, a.delta, row0, rows, tid);
    };

    issue(0, 0);
    cp_async_commit();  // K, V and tile 0

    const bool d_on = cq * kQuarter < f.D;    // this warp's D columns hold data
    const bool dv_on = cq * kQuarter < f.Dv;  // this warp's Dv columns hold data
    // Shared-memory addresses (bytes) for ldmatrix.
    const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem_bw));
    const uint32_t slice_off = ((kg * 16) * kStride + cq * kQuarter) * 2;  // rows kg*16.., cols cq*128..
    const uint32_t k_slice = sbase + kOffK + slice_off;
    const uint32_t v_slice = sbase + kOffV + slice_off;
    float* x_mine = sX + warp * 512;
    const float* x_group = sX + kg * 4 * 512;

    for (int it = 0; it < n_iter; ++it) {
      const int stage = it & 1;
      int h, qb;
      tile_of(it, h, qb);
      cp_async_wait<0>();
      __syncthreads();  // B1: tile it landed for all; every warp is done with tile it - 1
      if (it + 1 < n_iter) issue(it + 1, stage ^ 1);
      cp_async_commit();
      const uint32_t Qs = sbase + kOffQ + stage * kTileBytes;  // Q tile of this stage
      const uint32_t Os = sbase + kOffO + stage * kTileBytes;  // dO tile of this stage
      const float* Ls = sL + stage * kBr;
      const float* Ds = sDl + stage * kBr;

      // ---- S^T = K Q^T (16 keys x 32 queries), partial over this warp's columns ----
      float s[kBr / 8][4], dp[kBr / 8][4];
#pragma unroll
      for (int n = 0; n < kBr / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
      if (d_on) partial_abT<T>(s, k_slice, Qs + cq * kQuarter * 2, lane);
      store_partial(x_mine, s, lane);
      __syncthreads();  // B2
      if (dv_on) partial_abT<T>(dp, v_slice, Os + cq * kQuarter * 2, lane);
      sum_partials(s, x_group, lane);
      __syncthreads();  // B3: every warp has read the S partials
      store_partial(x_mine, dp, lane);
      __syncthreads();  // B4
      sum_partials(dp, x_group, lane);

      // ---- P^T, dS^T (rows = keys k0 + kg*16 + g (+8), columns = queries qb + n*8 + 2t (+1)) ----
      const bool full = tile_all_visible(f, qb, kBr, k0, kBc, qlen, kvlen, offset);
      uint32_t pa[kBr / 16][4], da[kBr / 16][4];  // P^T, dS^T as A fragments (k = queries)
#pragma unroll
      for (int n = 0; n < kBr / 8; ++n) {
        const float2 l2 = *reinterpret_cast<const float2*>(Ls + n * 8 + 2 * t);
        const float2 d2 = *reinterpret_cast<const float2*>(Ds + n * 8 + 2 * t);
        float pv[4], dsv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float lr = (e & 1) ? l2.y : l2.x;
          const float lse2 = lr == -INFINITY ? INFINITY : lr * kLog2e;  // P = 0 for lse = -inf
          const float dl = (e & 1) ? d2.y : d2.x;
          float p, ds;
          if (full) {
            p = fast_exp2(recomputed_exponent(fmaf(s[n][e], a.scale_log2, -lse2), lse2));
            ds = p * (dp[n][e] - dl);
          } else {
            const int i = qb + n * 8 + 2 * t + (e & 1);
            const int j = k0 + kg * 16 + g + (e >> 1) * 8;
            bool vis = band_visible(f, i, j, qlen, kvlen, offset);
            float x = s[n][e] * f.scale;
            if (vis) x += mask_value(f, b, h, i, j, &vis);
            p = vis ? fast_exp2(recomputed_exponent(fmaf(x, kLog2e, -lse2), lse2)) : 0.f;
            ds = vis ? p * (dp[n][e] - dl) : 0.f;
          }
          pv[e] = p;
          dsv[e] = ds;
        }
        // C tile n (queries n*8..) -> A fragment of k-step n / 2: even n = a0, a1; odd = a2, a3.
        pa[n / 2][(n & 1) * 2 + 0] = pack2<T>(pv[0], pv[1]);
        pa[n / 2][(n & 1) * 2 + 1] = pack2<T>(pv[2], pv[3]);
        da[n / 2][(n & 1) * 2 + 0] = pack2<T>(dsv[0], dsv[1]);
        da[n / 2][(n & 1) * 2 + 1] = pack2<T>(dsv[2], dsv[3]);
        if (n == cq) {  // this warp stores query tile cq of its group's dS: sdS[query][key]
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sdS[(n * 8 + 2 * t + (e & 1)) * kSdS + kg * 16 + g + (e >> 1) * 8] =
                from_float<T>(dsv[e]);
        }
      }

      // ---- dV += P^T dO, dK += dS^T Q (this warp's 16 keys x 128 columns) ----
      if (dv_on) acc_aB<T>(dv, pa, Os + cq * kQuarter * 2, lane);
      if (d_on) acc_aB<T>(dk, da, Qs + cq * kQuarter * 2, lane);
      __syncthreads();  // B5: sdS complete

      // ---- dQ[32 queries, cols warp*64..+64] = dS[32 x 32 keys] K[32 keys, cols] -> atomics ----
      const int c0 = warp * 64;
      if (c0 < f.D) {
        // K B fragments (trans): (keys 0-7 | 8-15) x (cols n | n + 8); dS A fragments
        // (non-trans): (queries 0-7 | 8-15) x (keys k | k + 8).
        const uint32_t kp =
            sbase + kOffK + ((lrow + (lmat & 1) * 8) * kStride + c0 + (lmat >> 1) * 8) * 2;
        const uint32_t dsp = sbase + kOffdS + ((lrow + (lmat & 1) * 8) * kSdS + (lmat >> 1) * 8) * 2;
        // Row qb + g, column c0 + 2t of this head's accumulator; the rest are int offsets.
        float* dq_base = a.dq_accum +
                         ((static_cast<int64_t>(b) * f.Hq + h) * f.Lq + qb + g) * f.D + c0 + 2 * t;
        // 16 queries x 32 columns at a time (16 accumulators: dK/dV hold 128 registers).
#pragma unroll 2
        for (int part = 0; part < (kBr / 16) * 2; ++part) {
          const int mt = part >> 1, nh = part & 1;
          float acc[4][4];
#pragma unroll
          for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
          for (int ks = 0; ks < kBc / 16; ++ks) {
            uint32_t af[4];
            ldmatrix_x4_ordered(af, dsp + (mt * 16 * kSdS + ks * 16) * 2);
#pragma unroll
            for (int n2 = 0; n2 < 2; ++n2) {
              uint32_t bf[4];
              ldmatrix_x4_trans_ordered(bf, kp + (ks * 16 * kStride + nh * 32 + n2 * 16) * 2);
              mma16816<T>(acc[2 * n2], af, bf[0], bf[1]);
              mma16816<T>(acc[2 * n2 + 1], af, bf[2], bf[3]);
            }
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int ri = mt * 16 + 8 * r;  // row qb + g + ri
            if (qb + g + ri < qlen) {
#pragma unroll
              for (int n = 0; n < 4; ++n) {
                const int cc = nh * 32 + n * 8;  // column c0 + 2t + cc
                if (c0 + 2 * t + cc < f.D) {
                  atomic_add2(dq_base + (ri * f.D + cc), acc[n][2 * r], acc[n][2 * r + 1]);
                }
              }
            }
          }
        }
      }
    }
    cp_async_wait<0>();
  }

  // ---- write dK (scaled) and dV: rows k0 + kg*16 + g (+8), every row < Lk ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = k0 + kg * 16 + g + 8 * r;
    if (j >= f.Lk) continue;
    // Keys past kv length: 0, selected (dS = 0 there, but 0 * a NaN query is NaN).
    const bool past = j >= kvlen;
    T* rk = static_cast<T*>(a.dk) + b * f.ks[0] + hk * f.ks[1] + static_cast<int64_t>(j) * f.ks[2];
    T* rv = static_cast<T*>(a.dv) + b * f.vs[0] + hk * f.vs[1] + static_cast<int64_t>(j) * f.vs[2];
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const int c = cq * kQuarter + n * 8 + 2 * t;
      if (c < f.D)
        *reinterpret_cast<uint32_t*>(rk + c) =
            pack2<T>(row_output(dk[n][2 * r], f.scale, past),
                     row_output(dk[n][2 * r + 1], f.scale, past));
      if (c < f.Dv)
        *reinterpret_cast<uint32_t*>(rv + c) =
            pack2<T>(row_output(dv[n][2 * r], 1.f, past), row_output(dv[n][2 * r + 1], 1.f, past));
    }
  }
}

// delta_i = sum_c dout_ic * out_ic (f32): one warp per row, 16-byte loads (Dv % 8 == 0).
template <typename T>
__global__ void __launch_bounds__(256) wide_delta_kernel(const Args a, float* delta, int64_t rows) {
  const FwdArgs& f = a.f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * 8 + warp;
  if (r >= rows) return;
  const QueryRow row = query_row(f, r);
  const int b = row.b, h = row.h, i = row.i;
  const int64_t off = b * f.os[0] + h * f.os[1] + static_cast<int64_t>(i) * f.os[2];
  const uint4* o = reinterpret_cast<const uint4*>(static_cast<const T*>(a.out) + off);
  const uint4* d = reinterpret_cast<const uint4*>(static_cast<const T*>(a.dout) + off);
  float acc = 0.f;
  for (int c8 = lane; c8 < f.Dv / 8; c8 += 32) {
    const uint4 x = o[c8], y = d[c8];
    const T* xs = reinterpret_cast<const T*>(&x);
    const T* ys = reinterpret_cast<const T*>(&y);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc += to_float<T>(xs[k]) * to_float<T>(ys[k]);
  }
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, x);
  // Rows past q length: 0 (their dout may hold anything; P = 0 there must give dS = 0).
  if (lane == 0) delta[r] = i < clamp_length(f.qlen, b, f.Lq) ? acc : 0.f;
}

// dq = dq_accum * scale (16-bit, q's strides): one warp per row, 8 columns a lane-step.
template <typename T>
__global__ void __launch_bounds__(256) wide_dq_convert_kernel(const Args a, void* dq, int64_t rows) {
  const FwdArgs& f = a.f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * 8 + warp;
  if (r >= rows) return;
  const QueryRow row = query_row(f, r);
  const int b = row.b, h = row.h, i = row.i;
  const float* src = a.dq_accum + r * f.D;
  T* dst = static_cast<T*>(dq) + b * f.qs[0] + h * f.qs[1] + static_cast<int64_t>(i) * f.qs[2];
  const float sc = f.scale;
  for (int c8 = lane; c8 < f.D / 8; c8 += 32) {
    const float4 x0 = *reinterpret_cast<const float4*>(src + c8 * 8);
    const float4 x1 = *reinterpret_cast<const float4*>(src + c8 * 8 + 4);
    uint4 o;
    o.x = pack2<T>(x0.x * sc, x0.y * sc);
    o.y = pack2<T>(x0.z * sc, x0.w * sc);
    o.z = pack2<T>(x1.x * sc, x1.y * sc);
    o.w = pack2<T>(x1.z * sc, x1.w * sc);
    *reinterpret_cast<uint4*>(dst + c8 * 8) = o;
  }
}

}  // namespace bwd_wide
}  // namespace cuda_flash
}  // namespace jax_sdpa
