// The flash-attention forward on Hopper's warpgroup MMA (wgmma) for fp16/bf16 head dims in
// (256, 512] (zero-padded to 512), the design in docs/cuda_flash.md ("The wgmma kernels").
// The callers try it first on every GPU (launch_forward_wgmma returns cudaErrorNotSupported
// where there is no sm_90a image, i.e. not an H100 / H200, or with JAX_SDPA_FLASH_WGMMA=0,
// and they run flash_fwd_wide_kernel). This translation unit is compiled for sm_90a alone
// (cuda/CMakeLists.txt): wgmma is an arch-specific feature.
//
// A block: 64 query rows of one head, two consumer warpgroups, 256 threads.
// - Q (64 x 512), one K and one V tile (64 keys x 512) live in shared memory as eight
//   [64][64] chunk tiles each, 128-byte swizzled (16-byte unit u of row r at u ^ (r % 8)),
//   filled by cp.async (zeros past the lengths and past D / Dv).
// - Warpgroup w computes S for keys 32 w .. 32 w + 31 of the tile over all of D (32
//   m64n32k16 steps, A = Q, B = K, both K-major in shared memory). The row maxima of the
//   two halves meet in shared memory; P (16-bit) goes to one swizzled [64][64] tile.
// - Warpgroup w accumulates O[:, 256 w .. 256 w + 255] += P V (4 m64n256k16 steps, A = P
//   K-major, B = V MN-major: dv contiguous in each key row): 128 fp32 registers a thread.
// - K of tile j + 1 loads during the softmax and PV of tile j; V of tile j + 1 during QK
//   of tile j + 1 (one buffer each, cp.async groups).
// Visibility, masks, sinks, lengths and empty rows as flash_fwd_wide_kernel.
#include "cuda/flash/flash_fwd_wgmma.h"

#include "cuda/flash/flash_attention.cuh"
#include "cuda/flash/flash_launch_checks.h"
#include "cuda/common/tma_helpers.cuh"
#include "cuda/common/wgmma_helpers.cuh"

namespace jax_sdpa {
namespace cuda_flash {
namespace wgmma {

using cuda_common::align_shared_1024;
using cuda_common::fence_proxy_async_smem;
using cuda_common::smem_addr;
using cuda_common::swizzle128_offset;
using cuda_common::wgmma_commit;
using cuda_common::wgmma_desc;
using cuda_common::wgmma_fence;
using cuda_common::wgmma_m64k16;
using cuda_common::wgmma_wait;

constexpr int kThreads = 256;            // two warpgroups
constexpr int kBM = 64;                  // query rows a block
constexpr int kBN = 64;                  // keys a tile (32 a warpgroup for S)
constexpr int kD = 512;                  // padded head dims (D and Dv)
constexpr int kChunks = kD / 64;         // 64-wide chunk tiles a row
constexpr int kTile = 64 * 128;          // one [64 rows][64] 16-bit chunk tile, bytes
constexpr int kQOff = 0;
constexpr int kKOff = kQOff + kChunks * kTile;
constexpr int kVOff = kKOff + kChunks * kTile;
constexpr int kPOff = kVOff + kChunks * kTile;  // P: one [64][64] tile
constexpr int kMOff = kPOff + kTile;            // row statistics: [2 warpgroups][64] float
constexpr int kSmem = kMOff + 2 * kBM * 4 + 1024;  // + alignment slack

// 64 rows x 512 of a [rows][stride] matrix into the eight chunk tiles at `tiles`; rows >=
// valid_rows and columns >= valid_cols are zero (cp.async with a zero source size).
template <typename T>
__device__ __forceinline__ void load_tiles(unsigned char* tiles, const T* g, int64_t stride,
                                           int valid_rows, int valid_cols) {
  constexpr int kUnits = kD * 2 / 16;  // 16-byte units a row
  for (int x = threadIdx.x; x < kBM * kUnits; x += kThreads) {
    const int r = x / kUnits, c = x % kUnits;
    const bool ok = r < valid_rows && c * 8 < valid_cols;
    cp_async16(tiles + (c >> 3) * kTile + swizzle128_offset(r, c & 7),
               ok ? g + r * stride + c * 8 : g, ok);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_wgmma_kernel(const FwdArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = align_shared_1024(smem_raw);
  const uint32_t base = smem_addr(smem);
  unsigned char* sQ = smem + kQOff;
  unsigned char* sK = smem + kKOff;
  unsigned char* sV = smem + kVOff;
  unsigned char* sP = smem + kPOff;
  float* sM = reinterpret_cast<float*>(smem + kMOff);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int wg = warp >> 2;                 // warpgroup: key half of S, column half of O
  const int rl0 = (warp & 3) * 16 + g;      // this thread's rows in the block: rl0, rl0 + 8
  const ForwardBlock<T> blk = forward_block<T, kBM, kBN>(a);
  const int h = blk.h, b = blk.b, q0 = blk.q0, qlen = blk.qlen, kvlen = blk.kvlen;
  const int64_t offset = blk.offset;
  const T *Q = blk.Q, *K = blk.K, *V = blk.V;
  const int kb_begin = blk.kb_begin, n_tiles = blk.n_tiles;

  // cp.async groups, oldest first: {Q, K_0}, {V_0}, then per tile {K_j+1}, {V_j+1}: so
  // before QK and before PV "all but the newest group" is the operand needed.
  load_tiles<T>(sQ, Q + static_cast<int64_t>(q0) * a.qs[2], a.qs[2], a.Lq - q0, a.D);
  if (n_tiles > 0)
    load_tiles<T>(sK, K + static_cast<int64_t>(kb_begin) * a.ks[2], a.ks[2], kvlen - kb_begin,
                  a.D);
  cp_async_commit();
  if (n_tiles > 0)
    load_tiles<T>(sV, V + static_cast<int64_t>(kb_begin) * a.vs[2], a.vs[2], kvlen - kb_begin,
                  a.Dv);
  cp_async_commit();

  const int row[2] = {q0 + rl0, q0 + rl0 + 8};
  float m[2], l[2];
  const float c = a.scale * kLog2e;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    if (a.sinks != nullptr && row[r] < qlen) {
      m[r] = a.sinks[b * a.sinks_bs + h] * kLog2e;
      l[r] = (t == 0 && wg == 0) ? 1.f : 0.f;  // counted once: lanes' and halves' sums add
    }
  }
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int kb = kb_begin + tile * kBN;
    cp_async_wait<1>();  // K of this tile (and Q) landed
    fence_proxy_async_smem();
    __syncthreads();

    // ---- S = Q K^T for this warpgroup's 32 keys ----
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;  // (the first step overwrites: scale_d 0)
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kD / 16; ++k) {
      const uint32_t in_tile = (k >> 2) * kTile + (k & 3) * 32;
      // S (32 keys) += Q K^T: A and B K-major.
      wgmma_m64k16<T, 32, 0, 0>(s, wgmma_desc(base + kQOff + in_tile, 16, 1024),
                                wgmma_desc(base + kKOff + in_tile + wg * 32 * 128, 16, 1024),
                                k > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    __syncthreads();  // both warpgroups are done with K: load the next tile's
    if (tile + 1 < n_tiles)
      load_tiles<T>(sK, K + static_cast<int64_t>(kb + kBN) * a.ks[2], a.ks[2],
                    kvlen - kb - kBN, a.D);
    cp_async_commit();

    // ---- scale (base 2), visibility, the row maxima of both halves ----
    const bool full = tile_all_visible(a, q0, kBM, kb, kBN, qlen, kvlen, offset);
    float mloc[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float x = s[4 * n + e] * c;
        if (!full) x = visible_score(a, b, h, row[r], kb + wg * 32 + n * 8 + 2 * t + (e & 1), qlen, kvlen, offset, x);
        s[4 * n + e] = x;
        mloc[r] = fmaxf(mloc[r], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) mloc[r] = quad_max(mloc[r]);
    if (t == 0) {
      sM[wg * kBM + rl0] = mloc[0];
      sM[wg * kBM + rl0 + 8] = mloc[1];
    }
    __syncthreads();
    float mu[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rl = rl0 + 8 * r;
      const float mnew = fmaxf(m[r], fmaxf(sM[rl], sM[kBM + rl]));  // same in both halves
      alpha[r] = online_rescale<SoftmaxExp::kFastExp2>(m[r], mnew, mu[r]);
      l[r] *= alpha[r];
    }

    // ---- P (16-bit) into the shared tile; O *= alpha ----
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float p0 = fast_exp2(s[4 * n + 0] - mu[0]), p1 = fast_exp2(s[4 * n + 1] - mu[0]);
      const float p2 = fast_exp2(s[4 * n + 2] - mu[1]), p3 = fast_exp2(s[4 * n + 3] - mu[1]);
      l[0] += p0 + p1;
      l[1] += p2 + p3;
      const int key = wg * 32 + n * 8 + 2 * t;  // key column in the tile (even)
      const uint32_t in_unit = (key & 7) * 2;
      *reinterpret_cast<uint32_t*>(sP + swizzle128_offset(rl0, key >> 3) + in_unit) =
          pack2<T>(p0, p1);
      *reinterpret_cast<uint32_t*>(sP + swizzle128_offset(rl0 + 8, key >> 3) + in_unit) =
          pack2<T>(p2, p3);
    }
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      o[4 * n + 0] *= alpha[0];
      o[4 * n + 1] *= alpha[0];
      o[4 * n + 2] *= alpha[1];
      o[4 * n + 3] *= alpha[1];
    }
    cp_async_wait<1>();  // V of this tile landed (the next K may still be in flight)
    fence_proxy_async_smem();
    __syncthreads();

    // ---- O[:, this half] += P V ----
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBN / 16; ++k)
      // O (256 columns) += P V: A = P K-major, B = V MN-major (trans-b).
      wgmma_m64k16<T, 256, 0, 1>(o, wgmma_desc(base + kPOff + k * 32, 16, 1024),
                                 wgmma_desc(base + kVOff + wg * 4 * kTile + k * 16 * 128, kTile,
                                            1024),
                                 1);
    wgmma_commit();
    wgmma_wait<0>();
    __syncthreads();  // both warpgroups are done with V and P: load the next tile's V
    if (tile + 1 < n_tiles)
      load_tiles<T>(sV, V + static_cast<int64_t>(kb + kBN) * a.vs[2], a.vs[2],
                    kvlen - kb - kBN, a.Dv);
    cp_async_commit();
  }
  cp_async_wait<0>();

  // ---- epilogue: the row sums of both halves, then this half's 256 columns ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = quad_sum(l[r]);
  }
  __syncthreads();  // (the last tile's readers of sM are done)
  if (t == 0) {
    sM[wg * kBM + rl0] = l[0];
    sM[wg * kBM + rl0 + 8] = l[1];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row[r];
    if (i >= a.Lq) continue;
    const int rl = rl0 + 8 * r;
    const float L = sM[rl] + sM[kBM + rl];
    const bool empty = softmax_row_empty(L) || i >= qlen;  // a NaN sum is not empty
    const float inv = row_inverse_sum(L, empty);
    T* O = static_cast<T*>(a.out) + b * a.os[0] + h * a.os[1] + static_cast<int64_t>(i) * a.os[2];
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      const int col = wg * 256 + n * 8 + 2 * t;
      if (col < a.Dv)
        *reinterpret_cast<uint32_t*>(O + col) =
            pack2<T>(row_output(o[4 * n + 2 * r], inv, empty), row_output(o[4 * n + 2 * r + 1], inv, empty));
    }
    if (wg == 0 && t == 0)
      a.lse[(static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i] =
          row_lse_base2(m[r], L, empty);
  }
#else
  __trap();  // compiled for sm_90a only (cuda/CMakeLists.txt)
#endif
}

template <typename T>
cudaError_t launch(const SdpaParams& p, const SdpaFwdBuffers& buf, cudaStream_t stream) {
  static_assert(kD == kWgmmaMaxHeadDim, "flash_launch_checks.h");
  if (!wgmma_head_dims(p)) return cudaErrorNotSupported;
  const FwdArgs a = make_fwd_args(p, buf, kD);
  auto kernel = flash_fwd_wgmma_kernel<T>;
  // No sm_90a image for this device (not an H100 / H200): the caller's kernels serve.
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaErrorNotSupported;
  }
  dim3 grid((a.Lq + kBM - 1) / kBM, a.Hq, a.B);
  kernel<<<grid, kThreads, kSmem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace wgmma

cudaError_t launch_forward_wgmma(const SdpaParams& p, const SdpaFwdBuffers& buf,
                                 cudaStream_t stream) {
  if (!wgmma_enabled(/*backward=*/false)) return cudaErrorNotSupported;
  switch (p.dtype) {
    case DType::kF16: return wgmma::launch<__half>(p, buf, stream);
    case DType::kBF16: return wgmma::launch<__nv_bfloat16>(p, buf, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
