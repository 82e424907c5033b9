// Flash-attention prefill backward: the generic kernels (docs/cuda_flash.md).
//
// From the saved lse (never recomputing the forward's statistics):
//   delta_kernel: delta_i = sum_d dout_id * out_id (f32) into scratch [B, Hq, Lq].
//   dkdv_kernel:  blockIdx.x = key_tile * (nD + nDv) + chunk, y = kv head, z = batch.
//                 A block owns 64 keys and one 64-column chunk of either dK (chunk < nD)
//                 or dV; it loops over every query head of the GQA group and every query
//                 tile whose band reaches its keys, recomputing S^T = K Q^T and
//                 dP^T = V dO^T, and accumulates dV += P^T dO or dK += dS^T Q. One block
//                 owns each dK/dV element: sums over the group need no atomics.
//   dq_kernel:    blockIdx.x = q_tile * nD + chunk, y = query head, z = batch: recomputes
//                 S and dP for its 64 queries and accumulates dQ += dS K (no atomics).
// Every operand streams through shared memory in 64 x 64 tiles (cp.async), so any head
// dim up to 512 fits in a small footprint; the price is recomputing S and dP once per
// output chunk (docs/cuda_flash.md lists the planned fused version).
#pragma once

#include "cuda/flash/flash_attention.cuh"

namespace jax_sdpa {
namespace cuda_flash {

struct BwdArgs {
  FwdArgs f;          // q, k, v, shapes, strides, masking (f.out / f.lse unused)
  const void* out;
  const void* dout;
  const float* lse;
  float* delta;       // scratch [B, Hq, Lq]
  void* dq;
  void* dk;
  void* dv;
  int nD, nDv;        // 64-column chunks of D and Dv
};

constexpr int kTileStrideB(int elem) { return kDK * elem + kPadBytes; }

// Per warp: s[16 x 64] += A[rows 16w.., :D] * B[64 rows, :D]^T, streaming 64-column
// chunks of both operands (global, row strides in elements) through sA / sB.
template <typename T, int kMode>
__device__ __forceinline__ void block_abT(float (&s)[8][4], const T* A, int64_t a_rs,
                                          int a_valid, const T* B, int64_t b_rs, int b_valid,
                                          int D, char* sA, char* sB) {
  constexpr int st = kTileStrideB(sizeof(T));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  for (int d0 = 0; d0 < D; d0 += kDK) {
    const int dk = min(kDK, D - d0);
    __syncthreads();
    load_tile<T>(sA, st, A, a_rs, kBM, a_valid, d0, dk, D);
    load_tile<T>(sB, st, B, b_rs, kBN, b_valid, d0, dk, D);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const char* abase = sA + (warp * 16) * st;
    for (int kk = 0; kk < dk; kk += 8) {
      if constexpr (kMode == 0) {
        const uint32_t a0 = *reinterpret_cast<const uint32_t*>(abase + g * st + kk * 2 + t * 4);
        const uint32_t a1 =
            *reinterpret_cast<const uint32_t*>(abase + (g + 8) * st + kk * 2 + t * 4);
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const uint32_t b0 =
              *reinterpret_cast<const uint32_t*>(sB + (n * 8 + g) * st + kk * 2 + t * 4);
          mma_16<T>(s[n], a0, a1, b0);
        }
      } else {
        const char* qa = abase + kk * 4;
        const float af[4] = {*reinterpret_cast<const float*>(qa + g * st + t * 4),
                             *reinterpret_cast<const float*>(qa + (g + 8) * st + t * 4),
                             *reinterpret_cast<const float*>(qa + g * st + (t + 4) * 4),
                             *reinterpret_cast<const float*>(qa + (g + 8) * st + (t + 4) * 4)};
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const char* kr = sB + (n * 8 + g) * st + kk * 4;
          const float bf[2] = {*reinterpret_cast<const float*>(kr + t * 4),
                               *reinterpret_cast<const float*>(kr + (t + 4) * 4)};
          mma_f32<kMode>(s[n], af, bf);
        }
      }
    }
  }
}

// Per warp: acc[16 x 64] += P[16 x 64] (accumulator layout) * C[64 rows (k), cols c0..c0+64)
// of a global matrix with `c_valid_cols` columns; C streams through sC.
template <typename T, int kMode>
__device__ __forceinline__ void block_pc(float (&acc)[8][4], const float (&p)[8][4],
                                         const T* C, int64_t c_rs, int c_valid_rows, int c0,
                                         int c_valid_cols, char* sC, float* sP) {
  constexpr int st = kTileStrideB(sizeof(T));
  constexpr int p_stride = kBN + 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  __syncthreads();
  load_tile<T>(sC, st, C, c_rs, kBN, c_valid_rows, c0, kDK, c_valid_cols);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  if constexpr (kMode == 0) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t a0 = pack2<T>(p[j][0], p[j][1]);
      const uint32_t a1 = pack2<T>(p[j][2], p[j][3]);
      const T* v0 = reinterpret_cast<const T*>(sC + (j * 8 + 2 * t) * st);
      const T* v1 = reinterpret_cast<const T*>(sC + (j * 8 + 2 * t + 1) * st);
#pragma unroll
      for (int n = 0; n < 8; ++n) mma_16<T>(acc[n], a0, a1, pack2_raw<T>(v0[n * 8 + g], v1[n * 8 + g]));
    }
  } else {
    float* P = sP + warp * 16 * p_stride;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      P[g * p_stride + n * 8 + 2 * t] = p[n][0];
      P[g * p_stride + n * 8 + 2 * t + 1] = p[n][1];
      P[(g + 8) * p_stride + n * 8 + 2 * t] = p[n][2];
      P[(g + 8) * p_stride + n * 8 + 2 * t + 1] = p[n][3];
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float af[4] = {P[g * p_stride + j * 8 + t], P[(g + 8) * p_stride + j * 8 + t],
                           P[g * p_stride + j * 8 + t + 4], P[(g + 8) * p_stride + j * 8 + t + 4]};
      const float* v0 = reinterpret_cast<const float*>(sC + (j * 8 + t) * st);
      const float* v1 = reinterpret_cast<const float*>(sC + (j * 8 + t + 4) * st);
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float bf[2] = {v0[n * 8 + g], v1[n * 8 + g]};
        mma_f32<kMode>(acc[n], af, bf);
      }
    }
    __syncwarp();
  }
}

// Visibility of key j to query i (lengths, band, masks; kFeat: segment ids) and the masked
// score (kFeat: soft-capped first, *dcap = d(capped)/d(scaled) = 1 - tanh^2; else 1).
template <bool kFeat>
__device__ __forceinline__ bool visible_score(const FwdArgs& a, int b, int h, int i, int j,
                                              int qlen, int kvlen, int64_t offset, float raw,
                                              float* score, float* dcap) {
  bool vis = band_visible(a, i, j, qlen, kvlen, offset);
  float x = raw * a.scale;
  *dcap = 1.f;
  if constexpr (kFeat) {
    if (a.soft_cap > 0.f) {
      const float th = tanhf(x * (1.f / a.soft_cap));
      x = a.soft_cap * th;
      *dcap = 1.f - th * th;
    }
    vis = vis && same_segment_ids(a.qseg, a.kvseg, b, a.Lq, a.Lk, i, j);
  }
  if (vis) x += mask_value(a, b, h, i, j, &vis);
  *score = x;
  return vis;
}

// The backward's P and dS of one visible-or-not score: P = exp(x - lse) <= 1 where
// visible (NaN when lse is), dS = P (dP - delta) selected (0 where hidden, so a hidden key's
// NaN dP stays out); *ds_scores takes dS * dcap (the soft cap's chain rule, for dQ and dK).
__device__ __forceinline__ float backward_p(bool vis, float x, float lse, float dp,
                                            float delta, float dcap, float* ds_scores) {
  const bool live = vis && lse != -INFINITY;
  const float p = live ? expf(recomputed_exponent(x - lse, lse)) : 0.f;
  *ds_scores = live ? p * (dp - delta) * dcap : 0.f;
  return p;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) flash_delta_kernel(BwdArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = static_cast<int64_t>(a.f.B) * a.f.Hq * a.f.Lq;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (r >= rows) return;
  const QueryRow row = query_row(a.f, r);
  const int b = row.b, h = row.h, i = row.i;
  const int64_t off = b * a.f.os[0] + h * a.f.os[1] + static_cast<int64_t>(i) * a.f.os[2];
  const T* o = static_cast<const T*>(a.out) + off;
  const T* d = static_cast<const T*>(a.dout) + off;
  float acc = 0.f;
  for (int c = lane; c < a.f.Dv; c += 32) acc += to_float<T>(o[c]) * to_float<T>(d[c]);
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, x);
  // Rows past q length: 0 (their dout may hold anything; P = 0 there must give dS = 0).
  if (lane == 0) a.delta[r] = i < clamp_length(a.f.qlen, b, a.f.Lq) ? acc : 0.f;
}

template <typename T, int kMode, bool kFeat>
__global__ void __launch_bounds__(kThreads) flash_dkdv_kernel(const BwdArgs ba) {
  extern __shared__ __align__(16) char smem[];
  constexpr int st = kTileStrideB(sizeof(T));
  char* sA = smem;
  char* sB = sA + kBM * st;
  char* sC = sB + kBN * st;
  float* sP = reinterpret_cast<float*>(sC + kBN * st);
  const FwdArgs& a = ba.f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int nch = ba.nD + ba.nDv;
  const int key_tile = blockIdx.x / nch;
  const int chunk = blockIdx.x - key_tile * nch;
  const bool is_dv = chunk >= ba.nD;
  const int c0 = (is_dv ? chunk - ba.nD : chunk) * kDK;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int k0 = key_tile * kBN;
  const RowLengths len = row_lengths(a, b);
  const int qlen = len.qlen, kvlen = len.kvlen;
  const int64_t offset = len.offset;

  const T* K = static_cast<const T*>(a.k) + b * a.ks[0] + hk * a.ks[1] + int64_t{k0} * a.ks[2];
  const T* V = static_cast<const T*>(a.v) + b * a.vs[0] + hk * a.vs[1] + int64_t{k0} * a.vs[2];
  const int kvalid = max(0, min(kBN, kvlen - k0));

  // Queries whose band reaches keys [k0, k0 + 64): i in [j - offset - wr, j - offset + wl].
  int64_t i_lo = 0, i_hi = qlen;
  if (a.wr >= 0 && k0 - offset - a.wr > i_lo) i_lo = k0 - offset - a.wr;
  if (a.wl >= 0 && k0 + kBN - offset + a.wl < i_hi) i_hi = k0 + kBN - offset + a.wl;
  if (kvalid == 0) i_hi = i_lo;  // keys beyond kv length: zero gradients

  float acc[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;

  for (int h = hk * a.G; h < (hk + 1) * a.G; ++h) {
    const T* Q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1];
    const T* dO = static_cast<const T*>(ba.dout) + b * a.os[0] + h * a.os[1];
    const float* lse = ba.lse + (static_cast<int64_t>(b) * a.Hq + h) * a.Lq;
    const float* delta = ba.delta + (static_cast<int64_t>(b) * a.Hq + h) * a.Lq;
    for (int64_t qb = (i_lo / kBM) * kBM; qb < i_hi; qb += kBM) {
      // Query rows past qlen are zero-filled: never read into dK / dV (qb < i_hi <= qlen).
      const int qv = static_cast<int>(qlen - qb < kBM ? qlen - qb : kBM);
      if constexpr (kFeat) {
        if (!segments_may_meet(a.qseg, a.kvseg, b, a.Lq, a.Lk, static_cast<int>(qb),
                               static_cast<int>(qb) + qv, k0, k0 + kvalid))
          continue;
      }
      float s[8][4], dp[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
      block_abT<T, kMode>(s, K, a.ks[2], kvalid, Q + qb * a.qs[2], a.qs[2], qv, a.D, sA, sB);
      block_abT<T, kMode>(dp, V, a.vs[2], kvalid, dO + qb * a.os[2], a.os[2], qv, a.Dv, sA,
                          sB);
      // Rows are keys j, columns are queries i.
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = k0 + warp * 16 + g + (e >= 2 ? 8 : 0);
          const int i = static_cast<int>(qb) + n * 8 + 2 * t + (e & 1);
          float x, dcap, ds;
          const bool vis =
              visible_score<kFeat>(a, b, h, i, j, qlen, kvlen, offset, s[n][e], &x, &dcap);
          s[n][e] = backward_p(vis, x, vis ? lse[i] : -INFINITY, dp[n][e],
                               vis ? delta[i] : 0.f, dcap, &ds);
          dp[n][e] = ds;
        }
      }
      if (is_dv)
        block_pc<T, kMode>(acc, s, dO + qb * a.os[2], a.os[2], qv, c0, a.Dv, sC, sP);
      else
        block_pc<T, kMode>(acc, dp, Q + qb * a.qs[2], a.qs[2], qv, c0, a.D, sC, sP);
    }
  }
  cp_async_wait<0>();
  // Write rows k0 + 16w + g (+8), columns c0 + 8n + 2t (+1).
  T* out = static_cast<T*>(is_dv ? ba.dv : ba.dk);
  const int64_t* os = is_dv ? a.vs : a.ks;
  const int ncols = is_dv ? a.Dv : a.D;
  const float mul = is_dv ? 1.f : a.scale;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = k0 + warp * 16 + g + 8 * r;
    if (j >= a.Lk) continue;
    const bool past = j >= kvlen;  // keys past kv length: 0, selected
    T* row = out + b * os[0] + hk * os[1] + static_cast<int64_t>(j) * os[2];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int c = c0 + n * 8 + 2 * t;
      if (c < ncols) {
        row[c] = from_float<T>(row_output(acc[n][2 * r], mul, past));
        row[c + 1] = from_float<T>(row_output(acc[n][2 * r + 1], mul, past));
      }
    }
  }
}

template <typename T, int kMode, bool kFeat>
__global__ void __launch_bounds__(kThreads) flash_dq_kernel(const BwdArgs ba) {
  extern __shared__ __align__(16) char smem[];
  constexpr int st = kTileStrideB(sizeof(T));
  char* sA = smem;
  char* sB = sA + kBM * st;
  char* sC = sB + kBN * st;
  float* sP = reinterpret_cast<float*>(sC + kBN * st);
  const FwdArgs& a = ba.f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int q_tile = blockIdx.x / ba.nD;
  const int c0 = (blockIdx.x - q_tile * ba.nD) * kDK;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / a.G;
  const int q0 = q_tile * kBM;
  const RowLengths len = row_lengths(a, b);
  const int qlen = len.qlen, kvlen = len.kvlen;
  const int64_t offset = len.offset;
  int key_lo = 0, key_hi = 0;
  if (q0 < qlen) {
    const int last_row = min(q0 + kBM, qlen) - 1;
    key_lo = static_cast<int>(band_keys(q0, offset, a.wl, a.wr, kvlen).first);
    key_hi = static_cast<int>(band_keys(last_row, offset, a.wl, a.wr, kvlen).last);
  }
  const T* Q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1] + int64_t{q0} * a.qs[2];
  const T* dO = static_cast<const T*>(ba.dout) + b * a.os[0] + h * a.os[1] + int64_t{q0} * a.os[2];
  const T* K = static_cast<const T*>(a.k) + b * a.ks[0] + hk * a.ks[1];
  const T* V = static_cast<const T*>(a.v) + b * a.vs[0] + hk * a.vs[1];
  const float* lse = ba.lse + (static_cast<int64_t>(b) * a.Hq + h) * a.Lq;
  const float* delta = ba.delta + (static_cast<int64_t>(b) * a.Hq + h) * a.Lq;
  const int qv = max(0, min(kBM, qlen - q0));  // rows past qlen zero-filled, never read

  float acc[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  for (int kb = (key_lo / kBN) * kBN; kb < key_hi; kb += kBN) {
    const int kvalid = kvlen - kb;
    if constexpr (kFeat) {
      if (!segments_may_meet(a.qseg, a.kvseg, b, a.Lq, a.Lk, q0, q0 + qv, kb,
                             min(kb + kBN, kvlen)))
        continue;
    }
    float s[8][4], dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
    block_abT<T, kMode>(s, Q, a.qs[2], qv, K + int64_t{kb} * a.ks[2], a.ks[2], kvalid, a.D, sA,
                        sB);
    block_abT<T, kMode>(dp, dO, a.os[2], qv, V + int64_t{kb} * a.vs[2], a.vs[2], kvalid, a.Dv,
                        sA, sB);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = q0 + warp * 16 + g + (e >= 2 ? 8 : 0);
        const int j = kb + n * 8 + 2 * t + (e & 1);
        float x, dcap, ds;
        const bool vis =
            visible_score<kFeat>(a, b, h, i, j, qlen, kvlen, offset, s[n][e], &x, &dcap);
        backward_p(vis, x, vis ? lse[i] : -INFINITY, dp[n][e], vis ? delta[i] : 0.f, dcap,
                   &ds);
        dp[n][e] = ds;
      }
    }
    block_pc<T, kMode>(acc, dp, K + int64_t{kb} * a.ks[2], a.ks[2], kvalid, c0, a.D, sC, sP);
  }
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = q0 + warp * 16 + g + 8 * r;
    if (i >= a.Lq) continue;
    const bool past = i >= qlen;  // queries past q length: 0, selected
    T* row = static_cast<T*>(ba.dq) + b * a.qs[0] + h * a.qs[1] + static_cast<int64_t>(i) * a.qs[2];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int c = c0 + n * 8 + 2 * t;
      if (c < a.D) {
        row[c] = from_float<T>(row_output(acc[n][2 * r], a.scale, past));
        row[c + 1] = from_float<T>(row_output(acc[n][2 * r + 1], a.scale, past));
      }
    }
  }
}

inline size_t bwd_smem_bytes(int elem) {
  return 3 * static_cast<size_t>(kBM) * kTileStrideB(elem) +
         (elem == 4 ? static_cast<size_t>(kWarps) * 16 * (kBN + 4) * 4 : 0);
}

template <typename T, int kMode>
cudaError_t launch_bwd_t(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                         cudaStream_t stream) {
  SdpaFwdBuffers fb;
  fb.q = buf.q;
  fb.k = buf.k;
  fb.v = buf.v;
  BwdArgs a;
  a.f = make_fwd_args(p, fb, kDK);
  a.out = buf.out;
  a.dout = buf.dout;
  a.lse = buf.lse;
  a.delta = delta;
  a.dq = buf.dq;
  a.dk = buf.dk;
  a.dv = buf.dv;
  a.nD = (a.f.D + kDK - 1) / kDK;
  a.nDv = (a.f.Dv + kDK - 1) / kDK;
  if (a.f.B == 0 || a.f.Hq == 0) return cudaSuccess;
  const size_t smem = bwd_smem_bytes(static_cast<int>(sizeof(T)));
  const int64_t rows = static_cast<int64_t>(a.f.B) * a.f.Hq * a.f.Lq;
  if (rows > 0) {
    flash_delta_kernel<T><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0,
                            stream>>>(a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  const bool feat = p.features() != 0;
  auto dkdv = feat ? flash_dkdv_kernel<T, kMode, true> : flash_dkdv_kernel<T, kMode, false>;
  auto dq = feat ? flash_dq_kernel<T, kMode, true> : flash_dq_kernel<T, kMode, false>;
  cudaError_t e = cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const int key_tiles = (a.f.Lk + kBN - 1) / kBN;
  if (key_tiles > 0) {
    const int hk = static_cast<int>(p.heads_kv);
    dkdv<<<dim3(key_tiles * (a.nD + a.nDv), hk, a.f.B), kThreads, smem, stream>>>(a);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  const int q_tiles = (a.f.Lq + kBM - 1) / kBM;
  if (q_tiles > 0) {
    dq<<<dim3(q_tiles * a.nD, a.f.Hq, a.f.B), kThreads, smem, stream>>>(a);
    e = cudaGetLastError();
  }
  return e;
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
