// Fast float32 flash-attention backward (FlashAttention-2 style), head dims <= 128.
//
// Grid (key_tiles, Hk, B); a block = 8 warps = 128 keys of kv head hk (16 keys per warp).
// It loops over the G query heads of its group and over the query tiles (kBr queries)
// whose band reaches its keys (i_lo / i_hi as in flash_dkdv_kernel), in an order rotated
// by the key tile (so that concurrent blocks of one head add into different dq rows).
// Per query tile (Q_i, dO_i, lse_i, delta_i cp.async'd into a 2-stage ring: the next tile
// is in flight while this one is computed):
//   S^T  = K Q^T            (warp: 16 keys x kBr queries; A = K from smem, B = Q)
//   dP^T = V dO^T
//   P^T  = exp(S^T * scale + mask - lse)   (0 where invisible or lse = -inf)
//   dS^T = P^T * (dP^T - delta)
//   dV  += P^T dO,  dK += dS^T Q   (accumulators in registers for the whole block: no atomics)
//   dS^T -> shared memory; __syncthreads; each warp computes a 16-query x (kD / column
//   groups) piece of dQ_i = dS K over the block's 128 keys and adds it (times scale) into
//   dq with float2 reductions (dq zeroed by the launcher).
// Tile sizes: kD = 64 (D, Dv <= 64): kBr = 64, 175 KB smem; kD = 128: kBr = 32, 222 KB
// smem (both: one 8-warp block per SM). 128 keys per block halves the dq atomics of a
// 64-key block and is what 8 warps x 16 rows give; 2 blocks per SM do not fit in smem.
//
// mma.sync m16n8k8 tf32 fragments (g = lane / 4, t = lane % 4):
//   A(16x8): a0=(g,t) a1=(g+8,t) a2=(g,t+4) a3=(g+8,t+4); B(8x8, k x n): b0=(t,g) b1=(t+4,g)
//   C(16x8): c0=(g,2t) c1=(g,2t+1) c2=(g+8,2t) c3=(g+8,2t+1).
// An accumulator is used as an A operand by permuting k: logical column t <-> actual 2t,
// logical t+4 <-> actual 2t+1, so a = {c0, c2, c1, c3} and the matching B reads rows 2t
// and 2t+1. Every shared row stride is = 4 (mod 32) floats: the (row g, col t) reads
// (banks 4g+t) and the (row 2t / 2t+1, col g) reads (banks 8t+g, 8t+4+g) are conflict-free.
// TF32 mode: operands in shared memory are rounded to tf32 once (each thread rounds the
// chunks it copied, after its cp.async wait), so the inner loops have no cvt.
// 3xTF32 mode (kMode 2): raw floats in smem, split hi/lo at use (lo*hi + hi*lo + hi*hi).
#pragma once

#include "cuda/flash/flash_attention.cuh"

namespace jax_sdpa {
namespace cuda_flash {
namespace bwd_tc {

constexpr int kBc = 128;  // keys per block
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

struct Args {
  FwdArgs f;  // q, k, v, shapes, strides, masking, scale (f.out / f.lse unused)
  const float* out;
  const float* dout;
  const float* lse;
  const float* delta;
  float* dq;
  float* dk;
  float* dv;
  float scale_log2;  // scale * log2(e)
};

template <int kD, int kBr>
struct Cfg {
  static constexpr int SK = kD + 4;   // row stride (floats) of K, V, Q, dO tiles
  static constexpr int SS = kBr + 4;  // row stride of dS^T (keys x queries)
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kBc * SK;
  static constexpr int kOffQ = kOffV + kBc * SK;       // 2 stages
  static constexpr int kOffO = kOffQ + 2 * kBr * SK;   // 2 stages
  static constexpr int kOffS = kOffO + 2 * kBr * SK;
  static constexpr int kOffL = kOffS + kBc * SS;       // lse * log2e (2 stages)
  static constexpr int kOffDl = kOffL + 2 * kBr;       // delta (2 stages)
  static constexpr int kFloats = kOffDl + 2 * kBr;
  static constexpr size_t kBytes = static_cast<size_t>(kFloats) * 4;
  static_assert(SK % 32 == 4 && SS % 32 == 4, "bank-conflict-free strides");
  static_assert(kOffS % 4 == 0 && kOffL % 4 == 0 && kOffDl % 4 == 0, "16-byte alignment");
};

// Rows [0, kRows) x columns [0, kD) of a global fp32 matrix -> smem (row stride SK floats);
// rows >= valid_rows and columns >= valid_cols are zero-filled. 16-byte chunks; chunk x of
// the tile always goes to thread x % kThreads (round_own relies on that).
template <int kRows, int kD>
__device__ __forceinline__ void tile_copy(float* s, const float* g, int64_t gstride,
                                          int valid_rows, int valid_cols) {
  constexpr int kCPR = kD / 4;
  constexpr int kTotal = kRows * kCPR;
  static_assert(kTotal % kThreads == 0, "tile chunks must divide the block");
#pragma unroll
  for (int it = 0; it < kTotal / kThreads; ++it) {
    const int x = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = x / kCPR;
    const int c = (x - r * kCPR) * 4;
    const bool ok = r < valid_rows && c < valid_cols;
    const float* src = ok ? g + r * gstride + c : g;
    cp_async16(s + r * (kD + 4) + c, src, ok);
  }
}

// Rounds this thread's own chunks of a tile (copied by tile_copy) to tf32 in place.
template <int kRows, int kD>
__device__ __forceinline__ void round_own(float* s) {
  constexpr int kCPR = kD / 4;
  constexpr int kTotal = kRows * kCPR;
#pragma unroll
  for (int it = 0; it < kTotal / kThreads; ++it) {
    const int x = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = x / kCPR;
    const int c = (x - r * kCPR) * 4;
    float4* p = reinterpret_cast<float4*>(s + r * (kD + 4) + c);
    float4 v = *p;
    v.x = round_tf32(v.x);
    v.y = round_tf32(v.y);
    v.z = round_tf32(v.z);
    v.w = round_tf32(v.w);
    *p = v;
  }
}

// A operand: hi (and lo for 3xTF32). In TF32 mode the inputs are already tf32-rounded.
template <int kMode>
struct AFrag {
  uint32_t h[4];
  uint32_t l[4];
};

template <int kMode>
__device__ __forceinline__ void make_a(AFrag<kMode>& a, float x0, float x1, float x2, float x3) {
  const float x[4] = {x0, x1, x2, x3};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kMode == 1) {
      a.h[i] = __float_as_uint(x[i]);  // already rounded to tf32
    } else {
      a.h[i] = to_tf32(x[i]);
      a.l[i] = to_tf32(x[i] - __uint_as_float(a.h[i]));
    }
  }
}

// d += A * B with B = (b0, b1) raw floats from smem (tf32-rounded already in TF32 mode).
template <int kMode>
__device__ __forceinline__ void mma_ab(float (&d)[4], const AFrag<kMode>& a, float b0, float b1) {
  if constexpr (kMode == 1) {
    const uint32_t b[2] = {__float_as_uint(b0), __float_as_uint(b1)};
    mma_tf32(d, a.h, b);
  } else {
    const uint32_t bh[2] = {to_tf32(b0), to_tf32(b1)};
    const uint32_t bl[2] = {to_tf32(b0 - __uint_as_float(bh[0])),
                            to_tf32(b1 - __uint_as_float(bh[1]))};
    mma_tf32x3(d, a.h, a.l, bh, bl);
  }
}

// One warp: acc[16 x kBr] += A[16 rows of sA, cols < ncols] * B[kBr rows of sB, cols < ncols]^T
// (both row-major in smem, row stride SK). A rows start at sA, B rows at sB.
template <int kMode, int kD, int kBr>
__device__ __forceinline__ void warp_abT(float (&acc)[kBr / 8][4], const float* sA,
                                         const float* sB, int ncols) {
  constexpr int SK = kD + 4;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kk = 0; kk < kD / 8; ++kk) {
    if (kk * 8 < ncols) {
      const float* pa = sA + kk * 8 + t;
      AFrag<kMode> a;
      make_a<kMode>(a, pa[g * SK], pa[(g + 8) * SK], pa[g * SK + 4], pa[(g + 8) * SK + 4]);
      const float* pb = sB + g * SK + kk * 8 + t;
#pragma unroll
      for (int n = 0; n < kBr / 8; ++n) mma_ab<kMode>(acc[n], a, pb[n * 8 * SK], pb[n * 8 * SK + 4]);
    }
  }
}

// One warp: acc[16 x kD] += X[16 x kBr] * B[kBr rows of sB, cols < ncols], X given as
// accumulator fragments x[n] (n8 tiles over kBr); permuted-k trick (see top).
template <int kMode, int kD, int kBr>
__device__ __forceinline__ void warp_cB(float (&acc)[kD / 8][4], const float (&x)[kBr / 8][4],
                                        const float* sB, int ncols) {
  constexpr int SK = kD + 4;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kt = 0; kt < kBr / 8; ++kt) {
    AFrag<kMode> a;
    make_a<kMode>(a, x[kt][0], x[kt][2], x[kt][1], x[kt][3]);
    const float* pb = sB + (kt * 8 + 2 * t) * SK + g;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n)
      if (n * 8 < ncols) mma_ab<kMode>(acc[n], a, pb[n * 8], pb[SK + n * 8]);
  }
}

// ---- run-time variants (JAX_SDPA_FLASH_BWD_VARIANT, read by the launcher per call) ----
// kVar bits: kVarFlat = no run-time guards inside the mma loops (work over the padded kD
// columns and all kBc keys: padding is zero-filled, so the result is the same; lets ptxas
// schedule loads across k-steps); kVarLdsm = ldmatrix.x4 for the S^T / dP^T operands (K, V
// A fragments; Q, dO B fragments) and for dQ's dS A fragment (dS stored [query][key] with
// keys permuted inside each 8-block, see below); kVarKreg / kVarVreg = K's / V's A
// fragments of this warp's 16 keys held in registers for the whole query loop (needs Ldsm).
constexpr int kVarFlat = 1;
constexpr int kVarLdsm = 2;
constexpr int kVarKreg = 4;
constexpr int kVarVreg = 8;

// A fragments (16 rows at sA, row stride kD + 4, k-steps kk) for all kk: regs[kk][0..3].
// Matrix i = lane / 8: rows (i & 1) * 8 + lane % 8, cols (i >> 1) * 4 -> a0 (g,t), a1 (g+8,t),
// a2 (g,t+4), a3 (g+8,t+4).
template <int kD>
__device__ __forceinline__ void load_a_frags(uint32_t (&regs)[kD / 8][4], const float* sA) {
  constexpr int SK = kD + 4;
  const int lane = threadIdx.x % 32, lrow = lane & 7, lmat = lane >> 3;
  const float* pa = sA + (lrow + (lmat & 1) * 8) * SK + (lmat >> 1) * 4;
#pragma unroll
  for (int kk = 0; kk < kD / 8; ++kk) ldmatrix_x4(regs[kk], pa + kk * 8);
}

// warp_abT with ldmatrix: A from areg (kAreg) or sA; B = rows of sB: matrix i = lane / 8
// supplies rows (i >> 1) * 8 + lane % 8 and cols (i & 1) * 4 of a 16-row block, i.e.
// r0 = b0 and r1 = b1 of n-tile 2 n2, r2 = b0 and r3 = b1 of n-tile 2 n2 + 1
// (b0 = (k t, n g) = row g col t, b1 = row g col t + 4).
template <int kMode, int kD, int kBr, bool kFlat, bool kAreg>
__device__ __forceinline__ void warp_abT_ldsm(float (&acc)[kBr / 8][4], const float* sA,
                                              const uint32_t (&areg)[kD / 8][4],
                                              const float* sB, int ncols) {
  constexpr int SK = kD + 4;
  const int lane = threadIdx.x % 32, lrow = lane & 7, lmat = lane >> 3;
  const float* pa = sA + (lrow + (lmat & 1) * 8) * SK + (lmat >> 1) * 4;
  const float* pb = sB + (lrow + (lmat >> 1) * 8) * SK + (lmat & 1) * 4;
#pragma unroll
  for (int kk = 0; kk < kD / 8; ++kk) {
    if (kFlat || kk * 8 < ncols) {
      uint32_t ar[4];
      if constexpr (kAreg) {
#pragma unroll
        for (int i = 0; i < 4; ++i) ar[i] = areg[kk][i];
      } else {
        ldmatrix_x4(ar, pa + kk * 8);
      }
      AFrag<kMode> a;
      make_a<kMode>(a, __uint_as_float(ar[0]), __uint_as_float(ar[1]), __uint_as_float(ar[2]),
                    __uint_as_float(ar[3]));
#pragma unroll
      for (int n2 = 0; n2 < kBr / 16; ++n2) {
        uint32_t br[4];
        ldmatrix_x4(br, pb + n2 * 16 * SK + kk * 8);
        mma_ab<kMode>(acc[2 * n2], a, __uint_as_float(br[0]), __uint_as_float(br[1]));
        mma_ab<kMode>(acc[2 * n2 + 1], a, __uint_as_float(br[2]), __uint_as_float(br[3]));
      }
    }
  }
}

// warp_cB without the column guard (kFlat) or with it.
template <int kMode, int kD, int kBr, bool kFlat>
__device__ __forceinline__ void warp_cB_v(float (&acc)[kD / 8][4], const float (&x)[kBr / 8][4],
                                          const float* sB, int ncols) {
  if constexpr (kFlat) {
    warp_cB<kMode, kD, kBr>(acc, x, sB, kD);  // n * 8 < kD: constant-folded
  } else {
    warp_cB<kMode, kD, kBr>(acc, x, sB, ncols);
  }
}

template <int kMode, int kD, int kBr, int kVar>
__global__ void __launch_bounds__(kThreads, 1) flash_bwd_tc_kernel(const Args a) {
  using C = Cfg<kD, kBr>;
  constexpr int SK = C::SK, SS = C::SS;
  constexpr int kNQ = kBr / 8;          // n8 tiles of queries in S^T
  constexpr int kND = kD / 8;           // n8 tiles of D / Dv
  constexpr int kRG = kBr / 16;         // dQ: row groups of 16 queries
  constexpr int kCG = kWarps / kRG;     // dQ: column groups
  constexpr int kQC = kD / kCG;         // dQ: columns per warp
  constexpr int kNQC = kQC / 8;
  static_assert(kWarps % kRG == 0 && kD % (kCG * 8) == 0, "dQ split");
  constexpr bool kFlat = (kVar & kVarFlat) != 0;
  constexpr bool kLdsm = (kVar & kVarLdsm) != 0;
  constexpr bool kKreg = (kVar & kVarKreg) != 0;
  constexpr bool kVreg = (kVar & kVarVreg) != 0;
  static_assert(kLdsm || !(kKreg || kVreg), "register-resident K / V fragments need kVarLdsm");
  // kLdsm: dS stored [query][key] (row stride SS2, kBr rows) with the keys of each 8-block
  // permuted: physical column p < 4 holds key 2p, p >= 4 holds key 2(p - 4) + 1. Then an
  // ldmatrix of [rows rq.., cols kb*8 + 0..3 | 4..7] gives A col t = key 2t, col t + 4 =
  // key 2t + 1: exactly the permuted-k A fragment that K's B reads (rows 2t, 2t + 1) expect.
  constexpr int SS2 = kBc + 4;
  static_assert(SS2 % 32 == 4 && kBr * SS2 <= kBc * SS, "dS [query][key] fits the dS^T area");
  extern __shared__ __align__(16) float smem_bwd_tc[];
  float* sK = smem_bwd_tc + C::kOffK;
  float* sV = smem_bwd_tc + C::kOffV;
  float* sQ = smem_bwd_tc + C::kOffQ;
  float* sO = smem_bwd_tc + C::kOffO;
  float* sS = smem_bwd_tc + C::kOffS;
  float* sL = smem_bwd_tc + C::kOffL;
  float* sDl = smem_bwd_tc + C::kOffDl;

  const FwdArgs& f = a.f;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int key_tile = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const KeyBlock blk = key_block<kBc, kBr>(f, key_tile, b);
  const int k0 = blk.k0, kvalid = blk.kvalid, qlen = blk.len.qlen, kvlen = blk.len.kvlen;
  const int64_t offset = blk.len.offset;
  const int qb_lo = blk.qb_lo, n_qt = blk.n_qt, n_iter = blk.n_iter;

  float dk[kND][4], dv[kND][4];
#pragma unroll
  for (int n = 0; n < kND; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
  uint32_t kreg[kD / 8][4], vreg[kD / 8][4];  // used only by kVarKreg / kVarVreg

  if (n_iter > 0) {
    const float* Kg = head_row<float>(f.k, f.ks, b, hk, k0);
    const float* Vg = head_row<float>(f.v, f.vs, b, hk, k0);
    tile_copy<kBc, kD>(sK, Kg, f.ks[2], kvalid, f.D);
    tile_copy<kBc, kD>(sV, Vg, f.vs[2], kvalid, f.Dv);
    cp_async_commit();

    const int rot = key_tile % n_iter;
    // Iteration -> (query head, first query of the tile).
    auto tile_of = [&](int it, int& h, int& qb) {
      rotated_visit<kBr>(it, rot, n_iter, n_qt, qb_lo, hk * f.G, h, qb);
    };
    auto issue = [&](int it, int stage) {
      int h, qb;
      tile_of(it, h, qb);
      const int rows = qlen - qb;  // rows >= qlen are zero-filled
      const float* Qg = head_row<float>(f.q, f.qs, b, h, qb);
      const float* Og = head_row<float>(a.dout, f.os, b, h, qb);
      tile_copy<kBr, kD>(sQ + stage * kBr * SK, Qg, f.qs[2], rows, f.D);
      tile_copy<kBr, kD>(sO + stage * kBr * SK, Og, f.os[2], rows, f.Dv);
      const int64_t row0 = (static_cast<int64_t>(b) * f.Hq + h) * f.Lq + qb;
      load_row_stats<kBr>(sL + stage * kBr, sDl + stage * kBr, a.lse, a.delta, row0, rows, tid);
    };

    issue(0, 0);
    cp_async_commit();

    for (int it = 0; it < n_iter; ++it) {
      const int stage = it & 1;
      int h, qb;
      tile_of(it, h, qb);
      if (it + 1 < n_iter) issue(it + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();  // everything but the tile just issued has landed
      float* Qs = sQ + stage * kBr * SK;
      float* Os = sO + stage * kBr * SK;
      float* Ls = sL + stage * kBr;
      const float* Ds = sDl + stage * kBr;
      if constexpr (kMode == 1) {
        if (it == 0) {
          round_own<kBc, kD>(sK);
          round_own<kBc, kD>(sV);
        }
        round_own<kBr, kD>(Qs);
        round_own<kBr, kD>(Os);
      }
      if (tid < kBr) {  // lse -> lse * log2(e); +inf (P = 0) for rows >= qlen or lse = -inf
        const float l = Ls[tid];
        Ls[tid] = (qb + tid >= qlen || l == -INFINITY) ? INFINITY : l * kLog2e;
      }
      __syncthreads();
      if constexpr (kKreg) {
        if (it == 0) load_a_frags<kD>(kreg, sK + warp * 16 * SK);  // K rounded + visible now
      }
      if constexpr (kVreg) {
        if (it == 0) load_a_frags<kD>(vreg, sV + warp * 16 * SK);
      }

      // ---- S^T = K Q^T, dP^T = V dO^T (this warp's 16 keys x kBr queries) ----
      float s[kNQ][4], dp[kNQ][4];
#pragma unroll
      for (int n = 0; n < kNQ; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
      if constexpr (kLdsm) {
        warp_abT_ldsm<kMode, kD, kBr, kFlat, kKreg>(s, sK + warp * 16 * SK, kreg, Qs, f.D);
        warp_abT_ldsm<kMode, kD, kBr, kFlat, kVreg>(dp, sV + warp * 16 * SK, vreg, Os, f.Dv);
      } else {
        warp_abT<kMode, kD, kBr>(s, sK + warp * 16 * SK, Qs, kFlat ? kD : f.D);
        warp_abT<kMode, kD, kBr>(dp, sV + warp * 16 * SK, Os, kFlat ? kD : f.Dv);
      }

      // ---- P^T, dS^T (elementwise; rows = keys, columns = queries) ----
      const bool full = tile_all_visible(f, qb, kBr, k0, kBc, qlen, kvlen, offset);
#pragma unroll
      for (int n = 0; n < kNQ; ++n) {
        const float2 l2 = *reinterpret_cast<const float2*>(Ls + n * 8 + 2 * t);
        const float2 d2 = *reinterpret_cast<const float2*>(Ds + n * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float lse2 = (e & 1) ? l2.y : l2.x;
          const float dl = (e & 1) ? d2.y : d2.x;
          float p;
          bool vis = true;
          if (full) {
            p = fast_exp2(recomputed_exponent(fmaf(s[n][e], a.scale_log2, -lse2), lse2));
          } else {
            const int i = qb + n * 8 + 2 * t + (e & 1);
            const int j = k0 + warp * 16 + g + (e >> 1) * 8;
            vis = band_visible(f, i, j, qlen, kvlen, offset);
            float x = s[n][e] * f.scale;
            if (vis) x += mask_value(f, b, h, i, j, &vis);
            p = vis ? fast_exp2(recomputed_exponent(fmaf(x, kLog2e, -lse2), lse2)) : 0.f;
          }
          // dS selected: a hidden key's NaN dP (or a NaN row's delta) stays out.
          const float ds = vis ? p * (dp[n][e] - dl) : 0.f;
          s[n][e] = kMode == 1 ? round_tf32(p) : p;
          dp[n][e] = kMode == 1 ? round_tf32(ds) : ds;
        }
      }

      // ---- dV += P^T dO, dK += dS^T Q ----
      warp_cB_v<kMode, kD, kBr, kFlat>(dv, s, Os, f.Dv);
      warp_cB_v<kMode, kD, kBr, kFlat>(dk, dp, Qs, f.D);

      // ---- dS^T -> smem ----
      if constexpr (kLdsm) {
        // dp[n][e] = dS^T[key warp*16 + g + 8 (e >> 1)][query n*8 + 2t + (e & 1)] ->
        // row query, column (warp*2 + (e >> 1)) * 8 + perm(g). Banks 8t + perm(g) + c:
        // conflict-free scalar stores.
        const int pg = (g & 1) ? 4 + (g >> 1) : (g >> 1);
        float* r0 = sS + (2 * t) * SS2 + warp * 16 + pg;
#pragma unroll
        for (int n = 0; n < kNQ; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) r0[(n * 8 + (e & 1)) * SS2 + (e >> 1) * 8] = dp[n][e];
      } else {
        float* r0 = sS + (warp * 16 + g) * SS + 2 * t;
#pragma unroll
        for (int n = 0; n < kNQ; ++n) {
          *reinterpret_cast<float2*>(r0 + n * 8) = make_float2(dp[n][0], dp[n][1]);
          *reinterpret_cast<float2*>(r0 + 8 * SS + n * 8) = make_float2(dp[n][2], dp[n][3]);
        }
      }
      __syncthreads();

      // ---- dQ[rows rq.., cols c0..] += dS K over the block's keys; reduce into dq ----
      {
        const int rg = warp % kRG, cg = warp / kRG;
        const int rq = rg * 16;
        const int c0 = cg * kQC;
        if (c0 < f.D) {
          float acc[kNQC][4];
#pragma unroll
          for (int n = 0; n < kNQC; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
          if constexpr (kFlat || kLdsm) {
            // Keys >= kvalid: K rows are zero-filled and dS is 0 there, so kFlat runs all
            // kBc keys and all kQC columns (columns >= D are computed and not written).
            const int lrow = lane & 7, lmat = lane >> 3;
            const float* pl = sS + (rq + lrow + (lmat & 1) * 8) * SS2 + (lmat >> 1) * 4;
#pragma unroll
            for (int kb = 0; kb < kBc / 8; ++kb) {
              if (kFlat || kb * 8 < kvalid) {
                AFrag<kMode> af;  // TF32 mode: dS was stored rounded
                if constexpr (kLdsm) {
                  uint32_t ar[4];
                  ldmatrix_x4(ar, pl + kb * 8);
                  make_a<kMode>(af, __uint_as_float(ar[0]), __uint_as_float(ar[1]),
                                __uint_as_float(ar[2]), __uint_as_float(ar[3]));
                } else {
                  const float* pa = sS + (kb * 8 + 2 * t) * SS + rq + g;
                  make_a<kMode>(af, pa[0], pa[8], pa[SS], pa[SS + 8]);
                }
                const float* pb = sK + (kb * 8 + 2 * t) * SK + c0 + g;
#pragma unroll
                for (int n = 0; n < kNQC; ++n)
                  if (kFlat || c0 + n * 8 < f.D)
                    mma_ab<kMode>(acc[n], af, pb[n * 8], pb[SK + n * 8]);
              }
            }
          } else {
#pragma unroll 4
          for (int kb = 0; kb < kBc / 8; ++kb) {
            if (kb * 8 < kvalid) {
              // A = dS (queries x keys), permuted k: logical t <-> key 2t, t+4 <-> 2t+1.
              const float* pa = sS + (kb * 8 + 2 * t) * SS + rq + g;
              AFrag<kMode> af;  // TF32 mode: dS^T was stored rounded
              make_a<kMode>(af, pa[0], pa[8], pa[SS], pa[SS + 8]);
              const float* pb = sK + (kb * 8 + 2 * t) * SK + c0 + g;
#pragma unroll
              for (int n = 0; n < kNQC; ++n)
                if (c0 + n * 8 < f.D) mma_ab<kMode>(acc[n], af, pb[n * 8], pb[SK + n * 8]);
            }
          }
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int i = qb + rq + g + 8 * r;
            if (i < qlen) {
              float* row = a.dq + b * f.qs[0] + h * f.qs[1] + static_cast<int64_t>(i) * f.qs[2];
#pragma unroll
              for (int n = 0; n < kNQC; ++n) {
                const int c = c0 + n * 8 + 2 * t;
                if (c < f.D) {
                  atomic_add2(row + c, acc[n][2 * r] * f.scale, acc[n][2 * r + 1] * f.scale);
                }
              }
            }
          }
        }
      }
    }
    cp_async_wait<0>();
  }

  // ---- write dK (scaled) and dV: rows k0 + 16 warp + g (+8), every row < Lk ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = k0 + warp * 16 + g + 8 * r;
    if (j >= f.Lk) continue;
    // Keys past kv length: 0, selected (dS = 0 there, but 0 * a NaN query is NaN).
    const bool past = j >= kvlen;
    float* rk = a.dk + b * f.ks[0] + hk * f.ks[1] + static_cast<int64_t>(j) * f.ks[2];
    float* rv = a.dv + b * f.vs[0] + hk * f.vs[1] + static_cast<int64_t>(j) * f.vs[2];
#pragma unroll
    for (int n = 0; n < kND; ++n) {
      const int c = n * 8 + 2 * t;
      if (c < f.D)
        *reinterpret_cast<float2*>(rk + c) =
            make_float2(row_output(dk[n][2 * r], f.scale, past),
                        row_output(dk[n][2 * r + 1], f.scale, past));
      if (c < f.Dv)
        *reinterpret_cast<float2*>(rv + c) =
            make_float2(row_output(dv[n][2 * r], 1.f, past),
                        row_output(dv[n][2 * r + 1], 1.f, past));
    }
  }
}

// delta_i = sum_c dout_ic * out_ic (one warp per row, float4 lanes; Dv <= 128).
__global__ void __launch_bounds__(256) delta_kernel(const Args a, float* delta, int64_t rows) {
  const FwdArgs& f = a.f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * 8 + warp;
  if (r >= rows) return;
  const QueryRow row = query_row(f, r);
  const int b = row.b, h = row.h, i = row.i;
  const int64_t off = b * f.os[0] + h * f.os[1] + static_cast<int64_t>(i) * f.os[2];
  float acc = 0.f;
  if (lane * 4 < f.Dv) {
    const float4 o = *reinterpret_cast<const float4*>(a.out + off + lane * 4);
    const float4 d = *reinterpret_cast<const float4*>(a.dout + off + lane * 4);
    acc = o.x * d.x + o.y * d.y + o.z * d.z + o.w * d.w;
  }
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, x);
  // Rows past q length: 0 (their dout may hold anything; P = 0 there must give dS = 0).
  if (lane == 0) delta[r] = i < clamp_length(f.qlen, b, f.Lq) ? acc : 0.f;
}

}  // namespace bwd_tc
}  // namespace cuda_flash
}  // namespace jax_sdpa
