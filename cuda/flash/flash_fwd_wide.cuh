// Fast fp16/bf16 flash-attention forward for head dims above cuDNN's 256 (D and Dv in
// (256, 512], zero-padded to 512): Gemma-style D = 512 prefill.
//
// A 64-row query tile is too wide for one warp's registers at Dv = 512 (16 rows x 512
// fp32 accumulators = 256 registers a lane), so a block's 8 warps form 4 row groups
// (16 rows) x 2 column halves (256 of D and of Dv):
// - S = Q K^T is computed once: each warp of a pair multiplies its half of D, the two
//   partial S tiles (16 x 32, fp32) are exchanged through shared memory and added
//   (a + b in both warps: identical, so both run the same softmax);
// - each warp then accumulates O for its 256 columns of Dv (128 registers a lane).
// mma.sync m16n8k16 (f32 accumulate); Q/K fragments by ldmatrix, V's by ldmatrix.trans;
// P stays in registers (S's accumulator layout is the A layout of m16n8k16). K/V tiles of
// 32 keys, double-buffered with cp.async; rows of 512 + 8 halves (conflict-free ldmatrix).
// Block skipping, masks, sinks, lengths and the full-tile fast path as in flash_fwd_tc.cuh.
#pragma once

#include "cuda/flash/flash_attention.cuh"

namespace jax_sdpa {
namespace cuda_flash {
namespace wide {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBM = 64;          // query rows per block (4 row groups of 16)
constexpr int kBN = 32;          // keys per tile
constexpr int kD = 512;          // padded head dim (D and Dv)
constexpr int kHalf = kD / 2;    // columns per warp of a pair
constexpr int kStride = kD + 8;  // elements per shared row (1040 bytes: 16-byte aligned)

// kRows x kD elements from global (row stride gstride) into shared rows of kStride;
// rows >= valid_rows and columns >= valid_cols are zero.
template <typename T, int kRows>
__device__ __forceinline__ void load_rows(T* s, const T* g, int64_t gstride, int valid_rows,
                                          int valid_cols) {
  constexpr int kVec = kD * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per row
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
#pragma unroll 4
  for (int x = threadIdx.x; x < kRows * kVec; x += kThreads) {
    const int r = x / kVec;
    const int c = (x % kVec) * kPer;
    const bool ok = r < valid_rows && c < valid_cols;
    cp_async16(s + r * kStride + c, ok ? g + r * gstride + c : g, ok);
  }
}

constexpr size_t smem_bytes(int elem) {
  return static_cast<size_t>(elem) * (kBM + 4 * kBN) * kStride +  // Q, 2 x (K, V)
         sizeof(float) * kWarps * 16 * 32;                         // partial-S exchange
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_wide_kernel(const FwdArgs a) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int kNT = kBN / 8;      // 8-key tiles of S
  constexpr int kOT = kHalf / 8;    // 8-column tiles of this warp's O
  extern __shared__ __align__(16) char smem_c[];
  T* sQ = reinterpret_cast<T*>(smem_c);
  T* sK = sQ + kBM * kStride;        // [2][kBN][kStride]
  T* sV = sK + 2 * kBN * kStride;    // [2][kBN][kStride]
  float* sX = reinterpret_cast<float*>(sV + 2 * kBN * kStride);  // [kWarps][16][32]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int rg = warp >> 1, ch = warp & 1;  // row group, column half
  const ForwardBlock<T> blk = forward_block<T, kBM, kBN>(a);
  const int h = blk.h, b = blk.b, q0 = blk.q0, qlen = blk.qlen, kvlen = blk.kvlen;
  const int64_t offset = blk.offset;
  const T *Q = blk.Q, *K = blk.K, *V = blk.V;
  const int kb_begin = blk.kb_begin, n_tiles = blk.n_tiles;

  auto load_kv = [&](int tile, int stage) {
    const int kb = kb_begin + tile * kBN;
    load_rows<T, kBN>(sK + stage * kBN * kStride, K + static_cast<int64_t>(kb) * a.ks[2],
                      a.ks[2], kvlen - kb, a.D);
    load_rows<T, kBN>(sV + stage * kBN * kStride, V + static_cast<int64_t>(kb) * a.vs[2],
                      a.vs[2], kvlen - kb, a.Dv);
  };
  load_rows<T, kBM>(sQ, Q + static_cast<int64_t>(q0) * a.qs[2], a.qs[2], a.Lq - q0, a.D);
  if (n_tiles > 0) load_kv(0, 0);
  cp_async_commit();

  const int row[2] = {q0 + rg * 16 + g, q0 + rg * 16 + g + 8};
  float m[2], l[2];
  const float c = a.scale * kLog2e;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    if (a.sinks != nullptr && row[r] < qlen) {
      m[r] = a.sinks[b * a.sinks_bs + h] * kLog2e;
      l[r] = t == 0 ? 1.f : 0.f;  // per-lane partial sums, reduced over the quad at the end
    }
  }
  float acc[kOT][4];
#pragma unroll
  for (int n = 0; n < kOT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;

  // ldmatrix addressing: lane supplies row (lane & 7) of matrix (lane >> 3).
  const int lrow = lane & 7, lmat = lane >> 3;
  // Q A fragments: matrices (rows 0-7 | 8-15) x (cols k | k + 8).
  const T* q_frag = sQ + (rg * 16 + lrow + (lmat & 1) * 8) * kStride + ch * kHalf + (lmat >> 1) * 8;
  // K B fragments for 2 n-tiles: (keys n0..7, cols k | k + 8), (keys n0+8..15, ...).
  const int k_frag_off = (lrow + (lmat >> 1) * 8) * kStride + ch * kHalf + (lmat & 1) * 8;
  // V B fragments (trans) for 2 n-tiles: (keys k..k+7 | k+8..15) x (cols n0 | n0 + 8).
  const int v_frag_off = (lrow + (lmat & 1) * 8) * kStride + ch * kHalf + (lmat >> 1) * 8;
  float* x_mine = sX + warp * 512;
  const float* x_partner = sX + (warp ^ 1) * 512;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    const int kb = kb_begin + tile * kBN;
    cp_async_wait<0>();
    __syncthreads();  // tile landed for all; every warp is done with tile - 1
    if (tile + 1 < n_tiles) load_kv(tile + 1, stage ^ 1);
    cp_async_commit();
    const T* sKs = sK + stage * kBN * kStride;
    const T* sVs = sV + stage * kBN * kStride;

    // ---- partial S over this warp's half of D ----
    float s[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll 4
    for (int kk = 0; kk < kHalf; kk += 16) {
      uint32_t qa[4];
      ldmatrix_x4(qa, q_frag + kk);
#pragma unroll
      for (int n2 = 0; n2 < kNT / 2; ++n2) {
        uint32_t kf[4];
        ldmatrix_x4(kf, sKs + n2 * 16 * kStride + k_frag_off + kk);
        mma16816<T>(s[2 * n2], qa, kf[0], kf[1]);
        mma16816<T>(s[2 * n2 + 1], qa, kf[2], kf[3]);
      }
    }
    // ---- exchange with the partner warp: S = mine + partner's ----
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) x_mine[(n * 4 + e) * 32 + lane] = s[n][e];
    __syncthreads();
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float o = x_partner[(n * 4 + e) * 32 + lane];
        s[n][e] = ch == 0 ? s[n][e] + o : o + s[n][e];  // same operand order in both
      }

    // ---- scale (base 2), visibility, online softmax ----
    const bool full = tile_all_visible(a, q0, kBM, kb, kBN, qlen, kvlen, offset);
    float mnew[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        float x = s[n][e] * c;
        if (!full) {
          // (visible_score, flash_attention.cuh, computes the same; using it changed this
          // validated kernel's machine code, so that waits for a GPU run.)
          const int i = row[r];
          const int j = kb + n * 8 + 2 * t + (e & 1);
          bool vis = band_visible(a, i, j, qlen, kvlen, offset);
          if (vis && a.mask_kind != 0) x += mask_value(a, b, h, i, j, &vis) * kLog2e;
          x = vis ? x : -INFINITY;
        }
        s[n][e] = x;
        mnew[r] = fmaxf(mnew[r], x);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mu;
      alpha[r] = online_rescale<SoftmaxExp::kFastExp2>(m[r], quad_max(mnew[r]), mu);
      mnew[r] = mu;
      l[r] *= alpha[r];
    }
    uint32_t pa[kNT / 2][4];  // P as A fragments, one per 16-key step
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const float p0 = fast_exp2(s[n][0] - mnew[0]), p1 = fast_exp2(s[n][1] - mnew[0]);
      const float p2 = fast_exp2(s[n][2] - mnew[1]), p3 = fast_exp2(s[n][3] - mnew[1]);
      l[0] += p0 + p1;
      l[1] += p2 + p3;
      pa[n / 2][(n & 1) * 2 + 0] = pack2<T>(p0, p1);
      pa[n / 2][(n & 1) * 2 + 1] = pack2<T>(p2, p3);
    }
#pragma unroll
    for (int n = 0; n < kOT; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }

    // ---- O[:, this half] += P V ----
#pragma unroll
    for (int ks = 0; ks < kNT / 2; ++ks) {
#pragma unroll
      for (int n2 = 0; n2 < kOT / 2; ++n2) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, sVs + ks * 16 * kStride + v_frag_off + n2 * 16);
        mma16816<T>(acc[2 * n2], pa[ks], vf[0], vf[1]);
        mma16816<T>(acc[2 * n2 + 1], pa[ks], vf[2], vf[3]);
      }
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: this warp's 16 rows x 256 columns, lse from the first half ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = quad_sum(l[r]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row[r];
    if (i >= a.Lq) continue;
    const bool empty = softmax_row_empty(l[r]) || i >= qlen;  // a NaN sum is not empty
    const float inv = row_inverse_sum(l[r], empty);
    T* O = static_cast<T*>(a.out) + b * a.os[0] + h * a.os[1] + static_cast<int64_t>(i) * a.os[2];
#pragma unroll
    for (int n = 0; n < kOT; ++n) {
      const int col = ch * kHalf + n * 8 + 2 * t;
      if (col < a.Dv)
        *reinterpret_cast<uint32_t*>(O + col) =
            pack2<T>(row_output(acc[n][2 * r], inv, empty), row_output(acc[n][2 * r + 1], inv, empty));
    }
    if (ch == 0 && t == 0)
      a.lse[(static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i] =
          row_lse_base2(m[r], l[r], empty);
  }
}

// Serves 16-bit inputs with 256 < D, Dv <= 512 (JAX_SDPA_FLASH_GENERIC set: never);
// returns cudaErrorNotSupported otherwise, and the caller runs the generic kernel.
template <typename T>
cudaError_t launch_forward_wide(const SdpaParams& p, const SdpaFwdBuffers& buf,
                                cudaStream_t stream) {
  if (p.head_dim <= 256 || p.head_dim_v <= 256 || p.head_dim > kD || p.head_dim_v > kD)
    return cudaErrorNotSupported;
  const FwdArgs a = make_fwd_args(p, buf, kD);
  const size_t smem = smem_bytes(static_cast<int>(sizeof(T)));
  auto kernel = flash_fwd_wide_kernel<T>;
  cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. a GPU with less shared memory: the generic kernel
    return cudaErrorNotSupported;
  }
  dim3 grid((a.Lq + kBM - 1) / kBM, a.Hq, a.B);
  kernel<<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace wide
}  // namespace cuda_flash
}  // namespace jax_sdpa
