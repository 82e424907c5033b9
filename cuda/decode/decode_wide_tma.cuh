// Wide-head decode kernel fed by TMA (sm_90+; bf16 / fp16; built for D = Dv = 512, 8 query
// rows a block): decode_wide_kernel's math (the warps split the head dims) on
// decode_tma_kernel's streaming (one producer thread, TMA copies, an mbarrier ring).
//
// Why: decode_wide_kernel's lanes issue 16-byte cp.async copies and its block barriers
// pace the ring, so at D512 (B1 H32/KV4 Lk8192) it streamed at about half the copy
// bandwidth. Here one producer thread keeps S - 1 stages of 16 keys (K + V: 32 KB at
// D512) in flight with a few TMA copies each, and the NW consumer warps never wait for
// a copy they could have issued earlier. Measured on the H200: only 2-4% faster; both
// kernels stream at 57-60% of DRAM peak, for a reason not yet found (docs/cuda_decode.md).
//
// A stage holds each 64-wide chunk of the head dims of its 16 keys as its own swizzled
// tile (one TMA copy per chunk: box 64 elements x 16 keys; 2 KB). With the 128-byte
// swizzle, chunk c' of key row r lands at (c' ^ (r % 8)) of the row's one line: so each
// chunk tile is decode_tma_kernel's D = 64 layout (qk_chunk<64>, pv_chunk<64>, key_row:
// conflict-free, tests/test_decode_tma_layout.py). (One box over all chunks would put a
// key's chunks on 8 consecutive lines, whose swizzle no longer depends on the key.)
//
// Per step of KT stages, consumer warp w
//   1. computes the partial scores of its D / NW head dims (Q in registers, read from
//      global memory while the first stages are in flight),
//   2. publishes them (a double-buffered exchange: one named barrier of the consumer
//      warps a step) and sums every warp's, so all warps run the same online softmax
//      (wide_softmax),
//   3. accumulates O^T += V^T P^T for its Dv / NW output columns and releases the stages.
// No cross-warp merge at the end: each warp writes its own columns (wide_store).
#pragma once

#include "cuda/decode/decode_tma.cuh"
#include "cuda/decode/decode_wide.cuh"

namespace jax_sdpa {
namespace cuda_decode {

template <typename T, int D, int DV, int NW, int S, int KT>
struct WideTmaConfig {
  static_assert(S >= 2 && KT >= 1 && KT <= S, "wide TMA decode: 1 <= KT <= S, S >= 2");
  static constexpr int kRows = 8;                 // query rows a block (A rows 8..15 are zero)
  static constexpr int kThreads = (NW + 1) * 32;  // + the producer warp
  static constexpr int DQ = D / NW;               // head dims of a warp's QK share
  static constexpr int DVW = DV / NW;             // output columns of a warp's PV share
  static_assert(DQ % 64 == 0 && DVW % 64 == 0,
                "wide TMA decode: whole 64-wide chunk tiles a warp (D / NW, Dv / NW % 64)");
  static constexpr int kChunkBytes = kTileKeys * 128;  // one chunk tile: 16 keys x 128 B
  static constexpr size_t kKBytes = static_cast<size_t>(D / 64) * kChunkBytes;
  static constexpr size_t kVBytes = static_cast<size_t>(DV / 64) * kChunkBytes;
  static constexpr size_t kStageBytes = kKBytes + kVBytes;  // whole 1024-byte swizzle atoms
  static constexpr size_t kScoreOff = static_cast<size_t>(S) * kStageBytes;
  // Partial scores: [2 (double buffer)][NW][KT][32 lanes] float4.
  static constexpr size_t kScoreBytes = 2 * NW * KT * 32 * sizeof(float4);
  static constexpr size_t kBarOff = kScoreOff + kScoreBytes;
  static constexpr size_t kSmem = kBarOff + 2 * S * sizeof(uint64_t) + 1024;  // + alignment
};

// Named barrier 1 (0 is __syncthreads) over the first `threads` threads: the consumer warps.
__device__ __forceinline__ void consumer_barrier(int threads) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory");
}

// KT: stages (16-key tiles) a consumer step takes. At one consumer warp per scheduler a
// step is one long dependent chain (mma, exchange, softmax, mma); KT independent tiles a
// step share that latency (decode_wide_kernel, one tile a step, issued an instruction
// every 4.9 cycles on the H200 and streamed at 57% of DRAM peak).
template <typename T, int D, int DV, int NW, int S, int KT>
__global__ void __launch_bounds__((NW + 1) * 32, 1)
    decode_wide_tma_kernel(const Args a, const __grid_constant__ TmaMaps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Cfg = WideTmaConfig<T, D, DV, NW, S, KT>;
  constexpr int RB = Cfg::kRows, CB = Cfg::kChunkBytes;
  constexpr int KC0 = Cfg::DQ / 64;   // this warp's first head-dim chunk tile / NW
  constexpr int NKC = Cfg::DQ / 32;   // this warp's 32-wide QK steps (two a chunk tile)
  constexpr int NVC = Cfg::DVW / 64;  // this warp's 64-wide dv chunk tiles (PV)
  constexpr int EPV = 16 / sizeof(T);
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = cuda_common::align_shared_1024(smem_raw);
  unsigned char* ring = smem;
  float4* Sx = reinterpret_cast<float4*>(smem + Cfg::kScoreOff);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff);
  uint64_t* empty = full + S;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  if (tid == NW * 32) prefetch_maps(maps);
  int ks0, ks1;
  const BlockWork wk = block_keys(a, RB, &ks0, &ks1);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  const int kvlen = wk.kvlen;
  const int nst = key_steps(ks0, ks1);

  // One copy per 64-wide chunk tile of a stage's K and V.
  auto issue = [&](int s, uint64_t* bar, int key) {
    int c2, c3, c4;
    tma_coords(maps, kvh, key, b, c2, c3, c4);
    issue_chunk_tiles<D, DV>(ring + s * Cfg::kStageBytes, Cfg::kKBytes, CB, maps, bar, c2, c3,
                             c4);
  };
  const uint32_t stage_bytes = static_cast<uint32_t>(Cfg::kStageBytes);
  // (Issuing the first S stages before this barrier, as decode_tma_kernel does, held the
  // consumers' Q loads back by 6 x 16 copies: D512 B1 Lk8192 2098 vs 2282 GB/s on the
  // H200.)
  if (tid == NW * 32) init_stage_ring<S>(full, empty, NW);
  __syncthreads();  // the barriers are initialized: from here on only mbarriers and bar 1

  if (w == NW) {
    // Producer: one thread; a stage is refilled once all NW consumers released it.
    if (lane == 0)
      produce_stages<S>(full, empty, stage_bytes, 0, nst, ks0, kTileKeys, issue);
    return;  // no block barrier below: the consumers end on their own
  }

  // Consumer warp w: head-dim chunk tiles [w KC0, (w + 1) KC0) of K, dv chunk tiles
  // [w NVC, (w + 1) NVC) of V. Its Q fragments (row g; rows 8..15 of A are zero) come
  // straight from global memory while the first stages are in flight.
  const RowInfo row = row_info(a, b, kvh, r0 + g, qlen, kvlen);
  uint4 qa[NKC];
  {
    const int r = r0 + g;
    const T* qrow = nullptr;
    if (r < a.R) {
      const HeadQuery hq = head_query(a, kvh, r);
      const int h = hq.h, i = hq.i;
      qrow = reinterpret_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
    }
#pragma unroll
    for (int c = 0; c < NKC; ++c)
      qa[c] = qrow != nullptr
                  ? *reinterpret_cast<const uint4*>(qrow + (w * KC0 + c / 2) * 64 +
                                                    qk_chunk<64>(c & 1, t) * EPV)
                  : make_uint4(0, 0, 0, 0);
  }
  const int krow0 = key_row(g), krow1 = key_row(g + 8);
  const int vrow0 = key_row(2 * t), vrow1 = key_row(2 * t + 1);
  const int vrow2 = key_row(2 * t + 8), vrow3 = key_row(2 * t + 9);
  const int vchunk = pv_chunk<64>(0, g);
  // Keys (as smem rows) of this thread's scores e = 0..3 of a tile: mma keys 2t, 2t+1,
  // 2t+8, 2t+9.
  int srow[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) srow[e] = key_row(8 * (e >> 1) + 2 * t + (e & 1));

  float m_run = -INFINITY, l_run = 0.f;
  float acc[NVC][4][4];
  fill_zero(acc);

  const int nsteps = (nst + KT - 1) / KT;
  for (int it = 0; it < nsteps; ++it) {
    // 1. Partial S = Q K^T of the step's tiles over this warp's head dims. A tile past
    // the split (the last step's) is absent: no wait, its scores are masked below.
    float sc[KT][2][4];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      fill_zero(sc[kt]);
      const int st = it * KT + kt;
      if (st >= nst) continue;
      const int s = st % S;
      mbar_wait(&full[s], (st / S) & 1);
      const unsigned char* Ks = ring + s * Cfg::kStageBytes;
      const int j0 = ks0 + st * kTileKeys;
      if (j0 + kTileKeys > ks1) {
        // Keys past the union of the rows' ranges: masked, but a fixed-size cache may
        // hold NaN / inf there (0 * NaN): zero V's rows in this warp's dv tiles (whole
        // 128-byte lines; the swizzle only moves chunks within a line).
        unsigned char* Vs = ring + s * Cfg::kStageBytes + Cfg::kKBytes;
#pragma unroll
        for (int c = 0; c < NVC; ++c)
          for (int idx = lane; idx < kTileKeys * 8; idx += 32)
            if (j0 + idx / 8 >= ks1)
              *reinterpret_cast<uint4*>(Vs + (w * NVC + c) * CB + idx * 16) =
                  make_uint4(0, 0, 0, 0);
        fence_proxy_async_smem();  // before TMA refills this stage
        __syncwarp();
      }
#pragma unroll
      for (int c = 0; c < NKC; ++c) {
        const unsigned char* Kc = Ks + (w * KC0 + c / 2) * CB;
        const int f = qk_chunk<64>(c & 1, t);
        const uint4 k0 = *reinterpret_cast<const uint4*>(Kc + swizzled<1>(krow0, f));
        const uint4 k1 = *reinterpret_cast<const uint4*>(Kc + swizzled<1>(krow1, f));
        mma_qk_step<T>(sc[kt], qa[c], make_uint4(0, 0, 0, 0), k0, k1);
      }
    }
    // 2. Exchange: row g's partial scores of this thread, then every warp's sum.
    float4* sx = Sx + (it & 1) * (NW * KT * 32);
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
      sx[(w * KT + kt) * 32 + lane] =
          make_float4(sc[kt][0][0], sc[kt][0][1], sc[kt][1][0], sc[kt][1][1]);
    // Every consumer wrote this step's partials; and (double buffer) every consumer
    // finished reading the other buffer in the previous step.
    consumer_barrier(NW * 32);
    float p[4 * KT];
    sum_warp_scores<NW, KT>(sx, lane, p);
    // Keys past the split's range (the rest of a partial stage, an absent tile) may be
    // visible to the row (they belong to the next split): INT_MAX masks them.
    const int jb = ks0 + it * KT * kTileKeys;
    uint32_t pb[2 * KT];
    wide_softmax<T>(a, row, p,
                    [&](int e) {
                      const int j = jb + (e >> 2) * kTileKeys + srow[e & 3];
                      return j < ks1 ? j : INT_MAX;
                    },
                    m_run, l_run, acc, pb);

    // 3. O^T += V^T P^T over this warp's output columns, then release the stages.
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const int st = it * KT + kt;
      if (st >= nst) continue;
      const unsigned char* Vs = ring + (st % S) * Cfg::kStageBytes + Cfg::kKBytes;
#pragma unroll
      for (int c = 0; c < NVC; ++c) {
        const unsigned char* Vc = Vs + (w * NVC + c) * CB;
        const uint4 v0 = *reinterpret_cast<const uint4*>(Vc + swizzled<1>(vrow0, vchunk));
        const uint4 v1 = *reinterpret_cast<const uint4*>(Vc + swizzled<1>(vrow1, vchunk));
        const uint4 v2 = *reinterpret_cast<const uint4*>(Vc + swizzled<1>(vrow2, vchunk));
        const uint4 v3 = *reinterpret_cast<const uint4*>(Vc + swizzled<1>(vrow3, vchunk));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t A[4];
          vt_fragment(v0, v1, v2, v3, j, A);
          mma16816<T>(acc[c][j], A[0], A[1], A[2], A[3], pb[2 * kt], pb[2 * kt + 1]);
        }
      }
    }
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int kt = 0; kt < KT; ++kt)
        if (it * KT + kt < nst) mbar_arrive(&empty[(it * KT + kt) % S]);  // may be refilled
    }
  }

  // m-tile j's rows g / g + 8 are dv 8 vchunk + 2j / + 1 of the warp's c-th tile.
  wide_store<T, DV>(a, acc, m_run, l_run, b, kvh, r0, split, qlen, w == 0,
                    [&](int c, int j) { return (w * NVC + c) * 64 + 8 * vchunk + 2 * j; });
#else
  __trap();  // sm_90+ only: the host never selects it elsewhere (decode_attention.cu)
#endif
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
