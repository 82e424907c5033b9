// The main kernel of the wide-head fp16/bf16 flash backward
// (head dims D, Dv in (256, 512], zero-padded to 512) on Hopper's warpgroup MMA (wgmma),
// a drop-in for flash_bwd_wide_kernel (cuda/flash_bwd_wide.cuh: same bwd_wide::Args, same
// semantics of P, dS, delta, masks, lengths, band, GQA and tile rotation; dq added UNSCALED
// into the fp32 dq_accum, dK scaled by f.scale at the end, dV unscaled). launch_backward_wide
// tries it first; it answers cudaErrorNotSupported (and flash_bwd_wide_kernel runs) where
// there is no sm_90a image (not an H100 / H200) or with JAX_SDPA_FLASH_WGMMA_BWD=0. sm_90a
// code only (cuda/CMakeLists.txt); the descriptor conventions are those of
// cuda/flash_fwd_wgmma.cu.
//
// Grid (ceil(Lk / 32), Hk, B); a block = 32 keys of kv head hk, two consumer warpgroups
// (256 threads, 1 block an SM). Shared memory, every tile 1024-aligned, 128-byte swizzled
// [rows][64] chunk tiles (16-byte unit u of row r at r * 128 + ((u ^ (r % 8)) << 4)):
//   K, V   [32 keys][512]: 8 chunk tiles [32][64] (4 KB) each, loaded once (zeros past
//          kvlen and past D / Dv);
//   Q, dO  [64 rows][512]: 8 chunk tiles [64][64] (8 KB) each, one buffer (zeros past qlen);
//   Pt, dSt P^T, dS^T [32 keys][64 rows] (one 4 KB tile each); dS [64 rows][32 keys] in a
//          [64][64] tile (units 0..3 of each row); sX (fp32 dP exchange, 8 KB); lse, delta.
// The block loops over the G query heads of its group and the 64-row query tiles whose band
// reaches its keys (i_lo / i_hi as the wide kernel), rotated by the key tile. Per tile:
//   1. wg0: S = Q K^T; wg1: dP = dO V^T (m64n32k16 x 32, A and B K-major).
//   2. wg1 hands dP to wg0 through sX (thread-private slots: the same accumulator layout);
//      wg0: P = exp2(S scale log2e - lse log2e) (0 where invisible or lse = -inf),
//      dS = P (dP - delta); P^T -> Pt, dS^T -> dSt, dS -> the dS tile (16-bit).
//   3. wg0: dV^T += dO^T P; wg1: dK^T += Q^T dS (per 64-row chunk m of dv / d: 4 x
//      m64n32k16, A MN-major (trans-a) from the dO / Q chunk tile m, B = Pt / dSt K-major):
//      8 x 16 fp32 accumulators a thread for the whole block.
//   4. dQ = dS K: warpgroup w, columns 256 w .. 256 w + 255 as 4 x (m64n64k16 x 2, A = dS
//      K-major, B = K MN-major (trans-b)), then float4 atomics into dq_accum.
//   5. The next tile's Q / dO / lse / delta cp.async loads are issued once step 3 is done
//      in both warpgroups, so they overlap step 4.
// Epilogue: dV^T and scale * dK^T staged (16-bit, [key][column]) in the free Q / dO tiles,
// then 16-byte stores of the rows < Lk.
// Every 64-wide chunk is multiplied in steps 1, 3 and 4, also those past D / Dv (zeros;
// dq atomics skip them): a wgmma under a condition ptxas can't prove warpgroup-uniform gets
// serialized. 252 registers (128 dK^T / dV^T accumulators), no spills.
//
// Barriers of a tile (B0 top, B1 dP in sX, B2 Pt / dSt / dS written, B3 step 3 done):
//   B0 (after cp.async.wait_group 0 + fence.proxy.async): this tile's Q / dO / lse / delta
//      (and, the first time, K / V) landed and are visible to wgmma; the previous tile's
//      step-4 wgmma reads of the dS tile are complete (each warpgroup waited) before step 2
//      rewrites it.
//   B1: wg1's dP writes to sX before wg0 reads them. (wg1's next writes come after B0 of the
//      next tile, after wg0's reads here.)
//   B2 (wg0 fences its st.shared to the async proxy first): Pt, dSt and dS are complete
//      before the step-3 / step-4 wgmmas read them.
//   B3 (after wgmma.wait_group 0 in both warpgroups): step 3 no longer reads Q, dO, Pt or
//      dSt, and step 2 finished with lse / delta (before B2): the next tile's loads may
//      overwrite Q / dO / lse / delta, and the next step 2 may rewrite Pt / dSt.
//   Epilogue E1 (after the loop): every wgmma is complete and no cp.async is pending before
//      the Q / dO tiles are reused for staging; E2: staging written before it is read.
#include "cuda/flash/flash_bwd_wgmma.h"

#include "cuda/flash/flash_attention.cuh"
#include "cuda/flash/flash_bwd_wide.cuh"
#include "cuda/flash/flash_launch_checks.h"
#include "cuda/common/tma_helpers.cuh"
#include "cuda/common/wgmma_helpers.cuh"

namespace jax_sdpa {
namespace cuda_flash {
namespace bwd_wgmma {

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
constexpr int kBc = 32;                  // keys a block
constexpr int kBr = 64;                  // query rows a tile
constexpr int kD = 512;                  // padded head dims (D and Dv)
constexpr int kChunks = kD / 64;         // 64-wide chunk tiles a row
constexpr int kKTile = kBc * 128;        // one [32][64] 16-bit chunk tile (K, V), bytes
constexpr int kQTile = kBr * 128;        // one [64][64] 16-bit chunk tile (Q, dO, dS), bytes
constexpr int kOffK = 0;
constexpr int kOffV = kOffK + kChunks * kKTile;
constexpr int kOffQ = kOffV + kChunks * kKTile;
constexpr int kOffO = kOffQ + kChunks * kQTile;
constexpr int kOffPt = kOffO + kChunks * kQTile;  // P^T [32 keys][64 rows]
constexpr int kOffdSt = kOffPt + kKTile;          // dS^T [32 keys][64 rows]
constexpr int kOffdS = kOffdSt + kKTile;          // dS [64 rows][32 keys] in a [64][64] tile
constexpr int kOffX = kOffdS + kQTile;            // dP: [4 float4][128 threads]
constexpr int kOffL = kOffX + 128 * 16 * 4;       // lse [64]
constexpr int kOffDl = kOffL + kBr * 4;           // delta [64]
constexpr int kSmemUsed = kOffDl + kBr * 4;
constexpr int kSmem = kSmemUsed + 1024;           // + alignment slack
constexpr int kStage = kD + 8;  // epilogue staging row (elements): 1040 bytes, 16-aligned
static_assert(kOffK % 1024 == 0 && kOffV % 1024 == 0 && kOffQ % 1024 == 0 &&
                  kOffO % 1024 == 0 && kOffPt % 1024 == 0 && kOffdSt % 1024 == 0 &&
                  kOffdS % 1024 == 0,
              "wgmma tiles 1024-byte aligned");
static_assert(kOffX % 16 == 0 && kOffL % 16 == 0 && kOffDl % 16 == 0, "16-byte aligned");
static_assert(kBc * kStage * 2 <= kChunks * kQTile, "dK / dV staging fits a Q / dO buffer");
static_assert(kSmem <= 227 * 1024, "fits sm_90's opt-in shared memory");

// kRows rows x 512 of a [rows][stride] matrix into the eight [kRows][64] chunk tiles at
// `tiles`; rows >= valid_rows and columns >= valid_cols are zero (cp.async, source size 0).
// Thread x copies unit x % 64 of rows x / 64 + 4 k: its shared addresses are two offsets
// plus constants and its source one pointer stepped by 4 rows (per-unit addresses would be
// hoisted out of the tile loop and spilled).
template <typename T, int kRows>
__device__ __forceinline__ void load_tiles(unsigned char* tiles, const T* g, int64_t stride,
                                           int valid_rows, int valid_cols) {
  static_assert(kRows % 8 == 0, "whole swizzle periods");
  const int c = threadIdx.x & 63;   // this thread's 16-byte unit of every row it copies
  const int r0 = threadIdx.x >> 6;  // rows r0, r0 + 4, r0 + 8, ...
  const uint32_t col = (c >> 3) * (kRows * 128);
  const uint32_t o0 = col + swizzle128_offset(r0, c & 7);      // row r0 (+ 8 k)
  const uint32_t o1 = col + swizzle128_offset(r0 + 4, c & 7);  // row r0 + 4 (+ 8 k)
  const bool col_ok = c * 8 < valid_cols;
  const T* src = g + r0 * stride + c * 8;
#pragma unroll
  for (int it = 0; it < kRows / 4; ++it) {
    const int r = r0 + 4 * it;
    const bool ok = col_ok && r < valid_rows;
    cp_async16(tiles + ((it & 1) ? o1 : o0) + (it >> 1) * 1024, ok ? src : g, ok);
    src += 4 * stride;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) flash_bwd_wgmma_kernel(const bwd_wide::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = align_shared_1024(smem_raw);
  const uint32_t base = smem_addr(smem);
  float4* sX = reinterpret_cast<float4*>(smem + kOffX);
  float* sL = reinterpret_cast<float*>(smem + kOffL);
  float* sDl = reinterpret_cast<float*>(smem + kOffDl);

  const FwdArgs& f = a.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2;              // warpgroup
  const int xi = tid & 127;              // thread index within the warpgroup
  const int rl0 = (warp & 3) * 16 + g;   // accumulator rows (M) of this thread: rl0, rl0 + 8
  const int key_tile = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const KeyBlock blk = key_block<kBc, kBr>(f, key_tile, b);
  const int k0 = blk.k0, kvalid = blk.kvalid, qlen = blk.len.qlen, kvlen = blk.len.kvlen;
  const int64_t offset = blk.len.offset;
  const int qb_lo = blk.qb_lo, n_qt = blk.n_qt, n_iter = blk.n_iter;

  // wg0: dV^T (chunk m: dv 64 m + row, key = column); wg1: dK^T (d 64 m + row, key).
  float acc[kChunks][16];
#pragma unroll
  for (int m = 0; m < kChunks; ++m)
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[m][i] = 0.f;

  if (n_iter > 0) {
    const T* Kg = head_row<T>(f.k, f.ks, b, hk, k0);
    const T* Vg = head_row<T>(f.v, f.vs, b, hk, k0);
    load_tiles<T, kBc>(smem + kOffK, Kg, f.ks[2], kvalid, f.D);
    load_tiles<T, kBc>(smem + kOffV, Vg, f.vs[2], kvalid, f.Dv);

    const int rot = key_tile % n_iter;
    auto tile_of = [&](int it, int& h, int& qb) {
      rotated_visit<kBr>(it, rot, n_iter, n_qt, qb_lo, hk * f.G, h, qb);
    };
    auto issue = [&](int it) {
      int h, qb;
      tile_of(it, h, qb);
      const int rows = qlen - qb;  // rows >= qlen are zero-filled (qb < qlen here)
      const T* Qg = head_row<T>(f.q, f.qs, b, h, qb);
      const T* Og = head_row<T>(a.dout, f.os, b, h, qb);
      load_tiles<T, kBr>(smem + kOffQ, Qg, f.qs[2], rows, f.D);
      load_tiles<T, kBr>(smem + kOffO, Og, f.os[2], rows, f.Dv);
      const int64_t row0 = (static_cast<int64_t>(b) * f.Hq + h) * f.Lq + qb;
      load_row_stats<kBr>(sL, sDl, a.lse, a.delta, row0, rows, tid);
    };

    issue(0);
    cp_async_commit();  // K, V and tile 0

    // Step 1 operands (wg0: Q, K; wg1: dO, V) and step 3 operands (wg0: dO^T, Pt; wg1: Q^T,
    // dSt).
    const uint32_t a1 = base + (wg ? kOffO : kOffQ);
    const uint32_t b1 = base + (wg ? kOffV : kOffK);
    const uint32_t a3 = base + (wg ? kOffQ : kOffO);
    const uint32_t b3 = base + (wg ? kOffdSt : kOffPt);
    unsigned char* sPt = smem + kOffPt;
    unsigned char* sdSt = smem + kOffdSt;
    unsigned char* sdS = smem + kOffdS;

    for (int it = 0; it < n_iter; ++it) {
      int h, qb;
      tile_of(it, h, qb);
      cp_async_wait<0>();
      fence_proxy_async_smem();
      __syncthreads();  // B0

      // ---- 1. wg0: S = Q K^T; wg1: dP = dO V^T (64 rows x 32 keys) ----
      float s[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i] = 0.f;  // (the first step overwrites: scale_d 0)
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kD / 16; ++k) {
        const int c = k >> 2, kk = k & 3;  // chunk tile, 16-column step in it
        wgmma_m64k16<T, 32, 0, 0>(s, wgmma_desc(a1 + c * kQTile + kk * 32, 16, 1024),
                                  wgmma_desc(b1 + c * kKTile + kk * 32, 16, 1024), k > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();

      // ---- 2. dP to wg0; P, dS (rows rl0 (+8), keys 8 i + 2 t (+1)) ----
      if (wg == 1) {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          sX[q * 128 + xi] = make_float4(s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3]);
      }
      __syncthreads();  // B1
      if (wg == 0) {
        const bool full = tile_all_visible(f, qb, kBr, k0, kBc, qlen, kvlen, offset);
        float lse2[2], dl[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float l = sL[rl0 + 8 * r];
          lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;  // P = 0 for lse = -inf
          dl[r] = sDl[rl0 + 8 * r];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 dp4 = sX[i * 128 + xi];
          const float dp[4] = {dp4.x, dp4.y, dp4.z, dp4.w};
          float dsv[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const int rl = rl0 + 8 * r;           // row in the tile
            const int kl = 8 * i + 2 * t + (e & 1);  // key in the block
            float p;
            bool hidden = false;
            if (full) {
              p = fast_exp2(
                  recomputed_exponent(fmaf(s[4 * i + e], a.scale_log2, -lse2[r]), lse2[r]));
            } else {
              const float x = visible_score(f, b, h, qb + rl, k0 + kl, qlen, kvlen, offset,
                                            s[4 * i + e] * a.scale_log2);
              p = fast_exp2(recomputed_exponent(x - lse2[r], lse2[r]));
              hidden = x == -INFINITY;
            }
            // dS selected: a hidden key's NaN dP stays out.
            const float ds = hidden ? 0.f : p * (dp[e] - dl[r]);
            dsv[e] = ds;
            // P^T, dS^T [key][row]: row rl is element rl % 8 of unit rl / 8 of line kl.
            const uint32_t tofs = swizzle128_offset(kl, rl >> 3) + (rl & 7) * 2;
            *reinterpret_cast<T*>(sPt + tofs) = from_float<T>(p);
            *reinterpret_cast<T*>(sdSt + tofs) = from_float<T>(ds);
          }
          // dS [row][key]: keys 8 i + 2 t, + 1 are elements 2 t, 2 t + 1 of unit i.
#pragma unroll
          for (int r = 0; r < 2; ++r)
            *reinterpret_cast<uint32_t*>(sdS + swizzle128_offset(rl0 + 8 * r, i) + t * 4) =
                pack2<T>(dsv[2 * r], dsv[2 * r + 1]);
        }
        fence_proxy_async_smem();  // the st.shared above, before the wgmmas read them
      }
      __syncthreads();  // B2

      // ---- 3. wg0: dV^T += dO^T P; wg1: dK^T += Q^T dS (chunk m: 64 rows of dv / d) ----
      wgmma_fence();
#pragma unroll
      for (int m = 0; m < kChunks; ++m) {
#pragma unroll
        for (int ks = 0; ks < kBr / 16; ++ks)
          wgmma_m64k16<T, 32, 1, 0>(acc[m],
                                    wgmma_desc(a3 + m * kQTile + ks * 16 * 128, kQTile, 1024),
                                    wgmma_desc(b3 + ks * 32, 16, 1024), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
      __syncthreads();  // B3: both warpgroups are done with Q, dO, Pt, dSt, lse, delta
      if (it + 1 < n_iter) issue(it + 1);
      cp_async_commit();

      // ---- 4. dQ[64 rows, chunk c] = dS[64 x 32 keys] K[32 keys, chunk c] -> atomics ----
      float* dq_tile = a.dq_accum + ((static_cast<int64_t>(b) * f.Hq + h) * f.Lq + qb) * f.D;
#pragma unroll 1
      for (int j = 0; j < 4; ++j) {
        const int c = wg * 4 + j;  // 64-column chunk of D (past D: zeros, no atomics)
        float d[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) d[i] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBc / 16; ++ks)
          wgmma_m64k16<T, 64, 0, 1>(d, wgmma_desc(base + kOffdS + ks * 32, 16, 1024),
                                    wgmma_desc(base + kOffK + c * kKTile + ks * 16 * 128, kKTile,
                                               1024),
                                    ks);
        wgmma_commit();
        wgmma_wait<0>();
        // One float4 atomic a thread and n8 block instead of two float2 (half the atomic
        // operations, the kernel's largest traffic): lanes t and t ^ 1 swap a pair, so an
        // even t holds columns 2t .. 2t + 3 of row rl0, an odd t columns 2t - 2 .. 2t + 1
        // of row rl0 + 8 (16-byte aligned: D is a multiple of 8).
        const bool odd = t & 1;
        const int row = rl0 + (odd ? 8 : 0);
        const int col = c * 64 + 2 * (t & ~1);
        const bool row_ok = qb + row < qlen;
        float* dst = dq_tile + static_cast<int64_t>(row) * f.D + col;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float x0 = __shfl_xor_sync(0xffffffffu, odd ? d[4 * i] : d[4 * i + 2], 1);
          const float x1 = __shfl_xor_sync(0xffffffffu, odd ? d[4 * i + 1] : d[4 * i + 3], 1);
          const float4 v = odd ? make_float4(x0, x1, d[4 * i + 2], d[4 * i + 3])
                               : make_float4(d[4 * i], d[4 * i + 1], x0, x1);
          if (row_ok && col + 8 * i < f.D) atomicAdd(reinterpret_cast<float4*>(dst + 8 * i), v);
        }
      }
    }
    cp_async_wait<0>();
  }

  // ---- epilogue: dV^T (wg0) / scale * dK^T (wg1) -> [32 keys][kStage] in the free Q / dO
  // tiles, then 16-byte stores of the rows < Lk ----
  __syncthreads();  // E1
  {
    T* st = reinterpret_cast<T*>(smem + (wg ? kOffO : kOffQ));
    const float sc = wg ? f.scale : 1.f;
#pragma unroll
    for (int m = 0; m < kChunks; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          st[(8 * i + 2 * t + (e & 1)) * kStage + 64 * m + rl0 + 8 * (e >> 1)] =
              from_float<T>(acc[m][4 * i + e] * sc);
  }
  __syncthreads();  // E2
  constexpr int kUnits = kD * 2 / 16;  // 16-byte units a row
#pragma unroll 4
  for (int u = tid; u < 2 * kBc * kUnits; u += kThreads) {
    const int is_k = u / (kBc * kUnits);  // 0: dV, 1: dK
    const int r = (u / kUnits) % kBc, c = u % kUnits;
    const int j = k0 + r;
    if (j < f.Lk && c * 8 < (is_k ? f.D : f.Dv)) {
      // Keys past kv length: 0, selected (dS = 0 there, but 0 * a NaN query is NaN).
      const uint4 v = j >= kvlen ? make_uint4(0, 0, 0, 0)
                                 : *reinterpret_cast<const uint4*>(smem + (is_k ? kOffO : kOffQ) +
                                                                   r * kStage * 2 + c * 16);
      T* dst = is_k ? static_cast<T*>(a.dk) + b * f.ks[0] + hk * f.ks[1] +
                          static_cast<int64_t>(j) * f.ks[2]
                    : static_cast<T*>(a.dv) + b * f.vs[0] + hk * f.vs[1] +
                          static_cast<int64_t>(j) * f.vs[2];
      *reinterpret_cast<uint4*>(dst + c * 8) = v;
    }
  }
#else
  __trap();  // compiled for sm_90a only (cuda/CMakeLists.txt)
#endif
}

template <typename T>
cudaError_t launch(const bwd_wide::Args& a, const SdpaParams& p, cudaStream_t stream) {
  auto kernel = flash_bwd_wgmma_kernel<T>;
  // No sm_90a image for this device (not an H100 / H200): the wide kernel serves.
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return cudaErrorNotSupported;
  }
  if (p.len_kv <= 0 || p.heads_kv <= 0 || p.batch <= 0) return cudaSuccess;  // nothing to do
  const dim3 grid(static_cast<unsigned>((p.len_kv + kBc - 1) / kBc),
                  static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.batch));
  kernel<<<grid, kThreads, kSmem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace bwd_wgmma

cudaError_t launch_backward_wgmma_main(const bwd_wide::Args& a, const SdpaParams& p,
                                       cudaStream_t stream) {
  if (!wgmma_enabled(/*backward=*/true)) return cudaErrorNotSupported;
  static_assert(bwd_wgmma::kD == kWgmmaMaxHeadDim, "flash_launch_checks.h");
  if (!wgmma_head_dims(p)) return cudaErrorNotSupported;
  switch (p.dtype) {
    case DType::kF16: return bwd_wgmma::launch<__half>(a, p, stream);
    case DType::kBF16: return bwd_wgmma::launch<__nv_bfloat16>(a, p, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
