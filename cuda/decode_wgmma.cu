// Decode kernel on Hopper's warpgroup MMA (wgmma) for 16-bit D = Dv = 512, 8 query rows a
// block: the default there on H100 / H200 (decode_attention.cu: tma_default). sm_90a code only
// (cuda/CMakeLists.txt); elsewhere, or with JAX_SDPA_CUDA_DECODE_WGMMA=off,
// decode_wide_tma_kernel runs. Same grid, work split (block_work, split_range in whole
// stages), masks (row_info, wide_softmax) and outputs (wide_finish_row: out + lse, or split
// partials for combine_kernel) as decode_wide_tma_kernel, so the host's plan serves both.
//
// Why: decode_wide_tma_kernel streams at ~58% of the copy bandwidth, paced by its consumer
// warps (Nsight: one warp a scheduler issuing every 5.5 cycles; dependent mma.sync chains and
// a cross-warp score exchange each step). Here a stage's math is ~50 wgmma instructions a warp
// and the warps exchange nothing but P.
//
// A block: one producer warp (one thread keeps an S-deep mbarrier ring of stages full with
// TMA copies: decode_wide_tma_kernel's init_stage_ring / produce_stages / issue_chunk_tiles)
// and one consumer warpgroup (4 warps). A stage holds KS keys of K and of V; each 64-wide
// chunk of the head dims is its own 128-byte-swizzled [KS][64] tile (one TMA box), 1024-aligned.
// Per stage:
//  1. S = Q K^T: 32 wgmma m64nKSk16 (B = K's chunk tile, K-major). A's 64 rows are the
//     block's 8 query rows eight times over: Q as eight swizzled [8][64] shared tiles read
//     with a zero stride byte offset (every 8-row core-matrix group of A reads the same 8
//     rows), or (QR) from registers, each warp giving row g's fragment for both its rows g
//     and g + 8. So each warp's accumulator holds the scores of all 8 rows (row g twice) and
//     each warp runs the online softmax on its own (wide_softmax: quad shuffles only).
//  2. P^T (16-bit, [8 rows][KS keys], K-major) into a swizzled [8][64] shared tile (warp w
//     writes keys 8w .. 8w + 7), fence.proxy.async, a named barrier of the consumers.
//  3. O^T += V^T P^T: per dv chunk c, KS / 16 wgmma m64n8k16, A = V's chunk tile read
//     MN-major (transposed, like dV^T += dO^T P in flash_bwd_wgmma.cu), B = the P^T tile.
//     Warp w holds dv 64 c + 16 w + g (+ 8) of query rows 2t, 2t + 1: 32 fp32 registers.
//  4. wgmma.wait_group 0; each warp releases the stage (the empty barrier counts 4).
// Keys past the split's range in a partial stage are masked by index, and their V rows are
// zeroed in shared memory (a fixed-size cache may hold NaN there). The epilogue stages O^T
// through the free ring as [8 rows][Dv] fp32 and writes whole rows.
#include "cuda/decode_wgmma.h"

#include "cuda/decode_wide_tma.cuh"
#include "cuda/tma_helpers.cuh"
#include "cuda/wgmma_helpers.cuh"

namespace jax_sdpa {
namespace cuda_decode {
namespace wgmma_decode {

using cuda_common::align_shared_1024;
using cuda_common::smem_addr;
using cuda_common::wgmma_commit;
using cuda_common::wgmma_desc;
using cuda_common::wgmma_fence;
using cuda_common::wgmma_m64k16;
using cuda_common::wgmma_m64k16_rs;
using cuda_common::wgmma_wait;

constexpr int kD = 512;             // D = Dv
constexpr int kChunks = kD / 64;    // 64-wide chunk tiles a row
constexpr int kRows = 8;            // query rows a block
constexpr int kConsumers = 128;     // one warpgroup
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kRowTile = kRows * 128;      // one [8][64] 16-bit swizzled tile (Q, P^T)

template <int KS, int S, bool QR>
struct Config {
  static_assert(KS == 16 || KS == 32, "wgmma decode: 16 or 32 keys a stage");
  static_assert(S >= 2, "wgmma decode: the ring needs a stage in flight");
  static constexpr int kChunkBytes = KS * 128;  // one [KS][64] chunk tile
  static constexpr int kKBytes = kChunks * kChunkBytes;
  static constexpr int kStageBytes = 2 * kKBytes;  // K, then V
  static constexpr int kQOff = S * kStageBytes;    // Q: 8 [8][64] tiles (QR: none)
  static constexpr int kPOff = kQOff + (QR ? 0 : kChunks * kRowTile);  // P^T: 2 tiles
  static constexpr int kBarOff = kPOff + 2 * kRowTile;
  static constexpr int kSmem = kBarOff + 2 * S * 8 + 1024;  // + alignment slack
  // Epilogue: O as [8][kOStride] fp32 in the ring; the pad of 4 floats makes the
  // accumulators' scattered stores conflict-free (rows 2t, 2t + 1 x 8 consecutive dv).
  static constexpr int kOStride = kD + 4;
  static_assert(kRows * kOStride * 4 <= S * kStageBytes, "O staging fits the ring");
  static_assert(kSmem <= 227 * 1024, "fits sm_90's opt-in shared memory");
};

// Byte offset of 16-byte unit u (0..7) of row r in a 128-byte-swizzled tile.
__device__ __forceinline__ uint32_t swz(int r, int u) {
  return static_cast<uint32_t>(r * 128 + ((u ^ (r & 7)) << 4));
}

template <typename T, int KS, int S, bool QR>
__global__ void __launch_bounds__(kThreads, 1)
    decode_wgmma_kernel(const Args a, const __grid_constant__ TmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Config<KS, S, QR>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = align_shared_1024(smem_raw);
  const uint32_t base = smem_addr(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff);
  uint64_t* empty = full + S;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  if (tid == kConsumers) prefetch_maps(maps);
  const BlockWork wk = block_work(a, kRows);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  int ks0, ks1;
  split_range<KS>(a, r0, kRows, split, qlen, wk.kvlen, &ks0, &ks1);
  const int nst = (ks1 - ks0 + KS - 1) / KS;

  if (tid == kConsumers) init_stage_ring<S>(full, empty, kConsumers / 32);
  __syncthreads();  // the barriers are initialized: from here on only mbarriers and bar 1

  if (w == kConsumers / 32) {
    // Producer: one thread; a stage is refilled once all 4 consumer warps released it.
    if (lane == 0)
      produce_stages<S>(maps, full, empty, static_cast<uint32_t>(Cfg::kStageBytes), 0, nst, kvh,
                        b, ks0, KS,
                        [&](int s, uint64_t* bar, int c2, int c3, int c4) {
                          issue_chunk_tiles<kD, kD>(smem + s * Cfg::kStageBytes, Cfg::kKBytes,
                                                    Cfg::kChunkBytes, maps, bar, c2, c3, c4);
                        });
    return;  // no block barrier below: the consumers end on their own
  }

  // Q rows (zeros past the group) while the first stages are in flight.
  const uint32_t q_base = base + Cfg::kQOff;
  uint32_t qf[QR ? 32 : 1][2];  // QR: row g's A fragments, columns 16 k + 2t (+ 8)
  if constexpr (QR) {
    const T* qrow = nullptr;
    if (r0 + g < a.R) {
      const HeadQuery hq = head_query(a, kvh, r0 + g);
      qrow = reinterpret_cast<const T*>(a.q) + b * a.qs[0] + hq.h * a.qs[1] + hq.i * a.qs[2];
    }
#pragma unroll
    for (int k = 0; k < 32; ++k)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        qf[k][h] = qrow != nullptr
                       ? *reinterpret_cast<const uint32_t*>(qrow + 16 * k + 8 * h + 2 * t)
                       : 0u;
  } else {
    // Row rr, 16-byte unit u of 64 -> unit u % 8 of row rr of chunk tile u / 8.
#pragma unroll
    for (int k = 0; k < kRows * 64 / kConsumers; ++k) {
      const int idx = tid + kConsumers * k;
      const int rr = idx >> 6, u = idx & 63;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r0 + rr < a.R) {
        const HeadQuery hq = head_query(a, kvh, r0 + rr);
        v = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(a.q) + b * a.qs[0] +
                                            hq.h * a.qs[1] + hq.i * a.qs[2] + u * 8);
      }
      *reinterpret_cast<uint4*>(smem + Cfg::kQOff + (u >> 3) * kRowTile + swz(rr, u & 7)) = v;
    }
    fence_proxy_async_smem();  // the st.shared above, before wgmma reads them
    consumer_barrier(kConsumers);
  }

  const RowInfo row = row_info(a, b, kvh, r0 + g, qlen, wk.kvlen);
  float m_run = -INFINITY, l_run = 0.f;
  float acc[2][4][4];  // O^T, dv chunk 4 c + j (wide_softmax's layout: [c][j][e])
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[c][j][e] = 0.f;

  for (int st = 0; st < nst; ++st) {
    const int s = st % S;
    const uint32_t k_base = base + s * Cfg::kStageBytes;
    const uint32_t v_base = k_base + Cfg::kKBytes;
    const int j0 = ks0 + st * KS;
    mbar_wait(&full[s], (st / S) & 1);
    __syncwarp();  // converged for the .sync.aligned wgmma instructions

    // 1. S = Q K^T (keys 8 i + 2t + (e & 1) of row g in sc[4 i + e]; e >= 2: row g again).
    float sc[KS / 2];
#pragma unroll
    for (int e = 0; e < KS / 2; ++e) sc[e] = 0.f;  // (the first step overwrites: scale_d 0)
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kD / 16; ++k) {
      const uint32_t in_tile = (k & 3) * 32;  // 16-column step k % 4 of chunk tile k / 4
      const uint64_t kd = wgmma_desc(k_base + (k >> 2) * Cfg::kChunkBytes + in_tile, 16, 1024);
      if constexpr (QR)
        wgmma_m64k16_rs<T, KS, 0>(sc, qf[k][0], qf[k][0], qf[k][1], qf[k][1], kd, k > 0);
      else
        wgmma_m64k16<T, KS, 0, 0>(sc, wgmma_desc(q_base + (k >> 2) * kRowTile + in_tile, 16, 0),
                                  kd, k > 0);
    }
    wgmma_commit();
    if (j0 + KS > ks1) {
      // A partial stage: keys past the range are masked, but a fixed-size cache may hold
      // NaN / inf there (0 * NaN): zero V's rows (whole 128-byte lines: the swizzle only
      // moves units within a line). Unit idx of the stage's V is row (idx / 8) % KS.
      unsigned char* vs = smem + s * Cfg::kStageBytes + Cfg::kKBytes;
      for (int idx = tid; idx < Cfg::kKBytes / 16; idx += kConsumers)
        if (j0 + ((idx >> 3) & (KS - 1)) >= ks1)
          *reinterpret_cast<uint4*>(vs + idx * 16) = make_uint4(0, 0, 0, 0);
    }
    wgmma_wait<0>();

    // 2. Online softmax of row g (the same in every warp), P^T to the shared tile.
    float p[KS / 4];
#pragma unroll
    for (int i = 0; i < KS / 8; ++i) {
      p[2 * i] = sc[4 * i];
      p[2 * i + 1] = sc[4 * i + 1];
    }
    uint32_t pb[KS / 8];
    // Keys past the split (the rest of a partial stage) may be visible to the row (they
    // belong to the next split): INT_MAX masks them.
    wide_softmax<T>(a, row, p,
                    [&](int e) {
                      const int j = j0 + 8 * (e >> 1) + 2 * t + (e & 1);
                      return j < ks1 ? j : INT_MAX;
                    },
                    m_run, l_run, acc, pb);
    const uint32_t p_off = Cfg::kPOff + (st & 1) * kRowTile;  // double buffer: see below
#pragma unroll
    for (int i = 0; i < KS / 8; ++i)
      if (i == w) *reinterpret_cast<uint32_t*>(smem + p_off + swz(g, i) + 4 * t) = pb[i];
    fence_proxy_async_smem();  // P^T and zeroed V rows, before wgmma (and TMA) use them
    // Every warp's P^T part and V zeros are written; every warp finished the previous
    // stage's PV, so the next stage may rewrite the other P^T buffer.
    consumer_barrier(kConsumers);

    // 3. O^T += V^T P^T.
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int k = 0; k < KS / 16; ++k)
        wgmma_m64k16<T, 8, 1, 0>(
            acc[c >> 2][c & 3],
            wgmma_desc(v_base + c * Cfg::kChunkBytes + k * 16 * 128, Cfg::kChunkBytes, 1024),
            wgmma_desc(base + p_off + k * 32, 16, 1024), 1);
    wgmma_commit();
    wgmma_wait<0>();
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);  // this warp is done with the stage
  }

  // Epilogue: O^T -> [8 rows][kOStride] fp32 in the ring, then warp w writes rows 2w, 2w + 1.
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  consumer_barrier(kConsumers);  // every warp's last wgmma reads of the ring are done
  float* os = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      os[(2 * t + (e & 1)) * Cfg::kOStride + 64 * c + 16 * w + g + 8 * (e >> 1)] =
          acc[c >> 2][c & 3][e];
  consumer_barrier(kConsumers);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int rr = 2 * w + q;
    const float M = __shfl_sync(0xffffffffu, m_run, rr * 4);
    const float L = __shfl_sync(0xffffffffu, l_run, rr * 4);
    wide_finish_row<T, kD>(a, b, kvh, r0, rr, split, qlen, M, L, lane == 0,
                           [&](auto* dst, float scale) {
#pragma unroll
                             for (int k = 0; k < kD / 128; ++k) {
                               const int col = 4 * (lane + 32 * k);
                               float4 o = *reinterpret_cast<const float4*>(
                                   os + rr * Cfg::kOStride + col);
                               o = make_float4(o.x * scale, o.y * scale, o.z * scale,
                                               o.w * scale);
                               if constexpr (std::is_same_v<decltype(dst), float*>)
                                 *reinterpret_cast<float4*>(dst + col) = o;
                               else
                                 store4<T>(dst + col, o);
                             }
                           });
  }
#else
  __trap();  // compiled for sm_90a only (cuda/CMakeLists.txt)
#endif
}

template <typename T, int KS, int S, bool QR>
WgmmaDecodeKernel describe() {
  constexpr auto kernel = &decode_wgmma_kernel<T, KS, S, QR>;
  WgmmaDecodeKernel k;
  k.func = reinterpret_cast<const void*>(kernel);
  k.launch = [](const Args& a, const TmaMaps* maps, dim3 grid, int threads, size_t smem,
                cudaStream_t st) {
    if (maps == nullptr) return cudaErrorInvalidValue;
    kernel<<<grid, threads, smem, st>>>(a, *maps);
    return cudaGetLastError();
  };
  k.threads = kThreads;
  k.smem = Config<KS, S, QR>::kSmem;
  k.keys = KS;
  return k;
}

}  // namespace wgmma_decode

WgmmaDecodeKernel decode_wgmma_kernel(bool bf16, int keys, int stages, bool q_regs) {
  using namespace wgmma_decode;
  auto pick = [&](auto tag) {
    using T = decltype(tag);
    if (keys == 32 && stages == 3) return q_regs ? describe<T, 32, 3, true>() : describe<T, 32, 3, false>();
    if (keys == 16 && stages == 6 && !q_regs) return describe<T, 16, 6, false>();
    return WgmmaDecodeKernel{};
  };
  return bf16 ? pick(__nv_bfloat16{}) : pick(__half{});
}

bool decode_wgmma_available() {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, wgmma_decode::decode_wgmma_kernel<__nv_bfloat16, 32, 3, false>) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
