// Decode kernel fed by TMA (sm_90+; bf16 / fp16; the template takes D, Dv in {64, 128}
// or D = Dv = 256, built for D = Dv = 128 and 256: decode_kernels.h).
//
// Why: decode_tc_kernel's warps each issue their own 16-byte cp.async copies; on the
// H200 it streams at 73% of DRAM peak where cuDNN reaches 85%, this kernel at 79-80%
// (docs/cuda_decode.md).
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
// conflict-free: the order of the head dims inside the QK loop (qk_chunk, the same
// for Q and K) and which smem row feeds each mma key index (key_row, the same for
// the QK n index, the PV k index and the masks). tests/test_decode_tma_layout.py
// checks both (bijections, no bank conflicts) on the host.
//
// At D = Dv = 256 a key row would span 4 lines, and the rows that one fragment load
// reads would share their swizzle phase in pairs (2-way conflicts on V). So there each
// 64-wide chunk of a stage is its own swizzled [keys][64] tile (one TMA copy a chunk, as
// decode_wide_tma_kernel): the D = 64 layout per chunk, conflict-free (kv_offset).
#pragma once

#include <cooperative_groups.h>

#include "cuda/decode/decode_tc.cuh"
#include "cuda/common/tma_helpers.cuh"

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

// The stage ring of the TMA kernels: full[s] completes when stage s's copies landed
// (one producer arrival + the bytes), empty[s] when its `consumers` warps released it.
template <int S>
__device__ __forceinline__ void init_stage_ring(uint64_t* full, uint64_t* empty, int consumers) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
    mbar_init(&full[s], 1);
    mbar_init(&empty[s], consumers);
  }
  mbar_init_fence();
}

// The maps' tensor coordinates of dims 2..4 for (kv head, key, batch) (selects, not an
// indexed local array: that would live on the stack).
__device__ __forceinline__ void tma_coords(const TmaMaps& maps, int kvh, int key, int b, int& c2,
                                           int& c3, int& c4) {
  auto pick = [&](int o) { return o == 0 ? kvh : (o == 1 ? key : b); };
  c2 = pick(maps.order[0]);
  c3 = pick(maps.order[1]);
  c4 = pick(maps.order[2]);
}

// The producer thread's loop over stages [it0, it1): stage `it` (keys key0 + it *
// keys_per_stage) goes to ring slot it % S once the slot's previous stage was released;
// issue(slot, slot barrier, first key) starts its copies. The first S stages need no
// release: the thread that initialized the ring issues them before the block's first
// barrier (start_ring).
template <int S, typename Issue>
__device__ __forceinline__ void produce_stages(uint64_t* full, uint64_t* empty,
                                               uint32_t stage_bytes, int it0, int it1, int key0,
                                               int keys_per_stage, Issue issue) {
  for (int it = it0; it < it1; ++it) {
    const int s = it % S;
    if (it >= S) mbar_wait(&empty[s], ((it / S) - 1) & 1);
    mbar_arrive_expect_tx(&full[s], stage_bytes);
    issue(s, &full[s], key0 + it * keys_per_stage);
  }
}

// One stage's copies when each 64-wide chunk of the head dims is its own [keys][64]
// tile (decode_wide_tma_kernel; decode_tma_kernel at D > 128): K's D / 64 tiles of
// tile_bytes from `stage`, then V's DV / 64 from stage + k_bytes, all completing on `bar`.
template <int D, int DV>
__device__ __forceinline__ void issue_chunk_tiles(unsigned char* stage, size_t k_bytes,
                                                  int tile_bytes, const TmaMaps& maps,
                                                  uint64_t* bar, int c2, int c3, int c4) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
    tma_load_5d(stage + c * tile_bytes, &maps.k, bar, 0, c, c2, c3, c4);
#pragma unroll
  for (int c = 0; c < DV / 64; ++c)
    tma_load_5d(stage + k_bytes + c * tile_bytes, &maps.v, bar, 0, c, c2, c3, c4);
}

// The producer thread's first act: fetch both descriptors while the block computes its
// work and key range.
__device__ __forceinline__ void prefetch_maps(const TmaMaps& maps) {
  cuda_common::tma_prefetch_map(&maps.k);
  cuda_common::tma_prefetch_map(&maps.v);
}

// The producer thread's start, before the block's first barrier: the ring initialized
// and the first min(S, nst) stages issued, so that the first bytes are on their way
// while the block sets up (Q rows).
template <int S, typename Issue>
__device__ __forceinline__ void start_ring(uint64_t* full, uint64_t* empty, int consumers,
                                           uint32_t stage_bytes, int nst, int key0,
                                           int keys_per_stage, Issue issue) {
  init_stage_ring<S>(full, empty, consumers);
  produce_stages<S>(full, empty, stage_bytes, 0, nst < S ? nst : S, key0, keys_per_stage, issue);
}

template <typename T, int D, int DV, int NT, int W, int S, bool CM = false>
struct TmaConfig {
  static_assert(((D == 64 || D == 128) && (DV == 64 || DV == 128)) || (D == 256 && DV == 256),
                "TMA decode: D, Dv in {64, 128}, or D = Dv = 256");
  static_assert(S >= 2, "TMA decode: the ring needs a stage in flight");
  static constexpr int kKeys = kTileKeys * W;  // keys a stage
  static constexpr int kThreads = (W + 1) * 32;  // + the producer warp
  // One swizzled tile a 64-wide chunk of the head dims (kv_offset), one copy each.
  static constexpr bool kChunked = D > 128;
  static constexpr size_t kKBytes = static_cast<size_t>(kKeys) * D * sizeof(T);
  static constexpr size_t kVBytes = static_cast<size_t>(kKeys) * DV * sizeof(T);
  static constexpr size_t kStageBytes = kKBytes + kVBytes;  // whole 1024-byte swizzle atoms
  static constexpr size_t kRingBytes = S * kStageBytes;
  static constexpr size_t kRedBytes = static_cast<size_t>(W) * 16 * (2 + DV) * sizeof(float);
  // CM (cluster merge): the block's merged partial (cluster_finish) after the warps'.
  static constexpr size_t kPartBytes = CM ? static_cast<size_t>(16) * (2 + DV) * sizeof(float) : 0;
  static constexpr size_t kQOff = kRingBytes > kRedBytes + kPartBytes ? kRingBytes
                                                                      : kRedBytes + kPartBytes;
  static constexpr size_t kQBytes = 16 * D * sizeof(T);
  static constexpr size_t kBarOff = kQOff + kQBytes;
  static constexpr size_t kSmem = kBarOff + 2 * S * sizeof(uint64_t) + 1024;  // + alignment slack
};

// Byte offset of 16-byte chunk c of row `row` in a swizzled tile of LPR 128-byte lines a row.
template <int LPR>
__host__ __device__ __forceinline__ constexpr uint32_t swizzled(int row, int c) {
  const int line = row * LPR + (c >> 3);
  return static_cast<uint32_t>(line * 128 + (((c & 7) ^ (line & 7)) << 4));
}
// The 16-byte head-dim chunk thread t reads in QK step c (32 dims a step), for Q and K.
template <int D>
__host__ __device__ __forceinline__ constexpr int qk_chunk(int c, int t) {
  if constexpr (D == 128) return (c & 1) * 2 + (c >> 1) * 8 + (t & 1) + (t >> 1) * 4;
  return 4 * c + t;
}
// The 16-byte dv chunk thread row g reads in PV step c (64 dv a step); its dv are 8x that.
template <int DV>
__host__ __device__ __forceinline__ constexpr int pv_chunk(int c, int g) {
  if constexpr (DV == 128) return 8 * c + g;
  if constexpr (DV == 256) return 8 * c + ((g >> 1) | ((g & 1) << 2));  // D64's, per chunk
  return (g >> 1) | ((g & 1) << 2);
}
// Byte offset of 16-byte chunk c (of the head dims) of row `row` of a warp's 16-key tile,
// from the tile's base (warp_tile_base): one swizzled tile of DIM / 64 lines a row, or at
// DIM > 128 (TmaConfig::kChunked) the chunk's own [KEYS][64] tile of the stage.
template <int DIM, int KEYS>
__host__ __device__ __forceinline__ constexpr uint32_t kv_offset(int row, int c) {
  if constexpr (DIM > 128) return (c >> 3) * (KEYS * 128) + swizzled<1>(row, c & 7);
  return swizzled<DIM / 64>(row, c);
}
// Where warp w's 16-key tile starts in a stage's K (or V) tiles.
template <typename T, int DIM>
__host__ __device__ __forceinline__ constexpr size_t warp_tile_base(int w) {
  if constexpr (DIM > 128) return w * kTileKeys * 128 * sizeof(char);
  return w * kTileKeys * DIM * sizeof(T);
}
// The smem row (key j0 + row) behind mma key index k = 8a + 2t + b of a 16-key tile.
__host__ __device__ __forceinline__ constexpr int key_row(int k) {
  const int a = k >> 3, t = (k >> 1) & 3, b = k & 1;
  return 4 * (2 * a + b) + (t ^ b);
}

// The split-K merge inside a thread-block cluster (sm_90+; CM kernels): the nsplit blocks
// of a unit are one cluster (launch attribute, cluster dims (1, nsplit, 1)). Each block
// folds its warps (red: block_finish's layout) into one partial in its own shared memory
// (`part`: max [16], sum [16], unnormalized out [16][DV]); then block k of the cluster
// merges its share of the 4-wide output columns of every row over all the cluster's
// partials (distributed shared memory) and writes out and lse. No partials in global
// memory, no combine launch. Every thread of every block calls it (cluster barriers);
// XW trailing warps (the producer) take no work. (Its warp fold repeats block_finish's
// first pass; sharing one helper changed the validated kernels' code, so it waits for a
// GPU run to re-check both.)
template <typename T, int DV, int W, int XW>
__device__ __forceinline__ void cluster_finish(const Args& a, float* red, float* part, int RB,
                                               int b, int kvh, int r0, int qlen) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const float* red_m = red;
  const float* red_l = red + W * 16;
  const float* red_o = red + 2 * W * 16;
  float* pm = part;
  float* pl = part + 16;
  float* po = part + 32;
  constexpr int DV4 = DV / 4;
  const int nthreads = W * 32;
  const bool idle = XW > 0 && threadIdx.x >= nthreads;
  __shared__ float s_coef[16][W];
  if (threadIdx.x < RB) {
    const int rr = threadIdx.x;
    float L;
    const float M = merge_warp_stats<W>(red_m, red_l, rr, s_coef[rr], &L);
    pm[rr] = M;
    pl[rr] = L;
  }
  __syncthreads();
  for (int idx = idle ? RB * DV4 : threadIdx.x; idx < RB * DV4; idx += nthreads) {
    const int rr = idx / DV4, c = idx - rr * DV4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float cw = s_coef[rr][w];
      const float4 x = *reinterpret_cast<const float4*>(red_o + (w * 16 + rr) * DV + 4 * c);
      o.x = fmaf(cw, x.x, o.x);
      o.y = fmaf(cw, x.y, o.y);
      o.z = fmaf(cw, x.z, o.z);
      o.w = fmaf(cw, x.w, o.w);
    }
    *reinterpret_cast<float4*>(po + rr * DV + 4 * c) = o;
  }
  cluster.sync();  // every block's partial is complete and visible to the cluster
  const int C = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int cpb = (DV4 + C - 1) / C;  // 4-wide columns a block
  const int c0 = rank * cpb;
  for (int idx = idle ? RB * cpb : threadIdx.x; idx < RB * cpb; idx += nthreads) {
    const int rr = idx / cpb, c = c0 + (idx - rr * cpb);
    const int r = r0 + rr;
    if (c >= DV4 || r >= a.R) continue;
    float M = -INFINITY;
    for (int k = 0; k < C; ++k) M = fmaxf(M, cluster.map_shared_rank(pm, k)[rr]);
    float L = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    {  // also when M = -inf: a block of a NaN row has max -inf and a NaN sum
      for (int k = 0; k < C; ++k) {
        const float mk = cluster.map_shared_rank(pm, k)[rr];
        if (mk == -INFINITY && cluster.map_shared_rank(pl, k)[rr] == 0.f) continue;
        const float wk = exp2f(mk - M);
        L = fmaf(wk, cluster.map_shared_rank(pl, k)[rr], L);
        const float4 x =
            *reinterpret_cast<const float4*>(cluster.map_shared_rank(po, k) + rr * DV + 4 * c);
        o.x = fmaf(wk, x.x, o.x);
        o.y = fmaf(wk, x.y, o.y);
        o.z = fmaf(wk, x.z, o.z);
        o.w = fmaf(wk, x.w, o.w);
      }
    }
    const HeadQuery hq = head_query(a, kvh, r);
    const int h = hq.h, i = hq.i;
    const int64_t grow = (static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i;
    float scale, lse;
    row_normalizer(a, b, h, i, qlen, M, L, &scale, &lse);
    if (c == 0) a.lse[grow] = lse;
    store4<T>(reinterpret_cast<T*>(a.out) + out_offset(a, b, h, i) + 4 * c,
              scaled_row(o, scale));
  }
  cluster.sync();  // no block leaves while the others still read its partial
}

// PAGED: K and V are page pools (page size a multiple of 16) mapped as (kv head, key in
// page, page): each consumer warp's 16-key tile is its own copy, at the page the table
// places it on (the producer thread looks the pages up). A tile past the split's keys or
// on a page outside [0, num_pages) is fetched from page num_pages, outside the map:
// zero-filled, nothing read, and its keys are invisible.
template <typename T, int D, int DV, int NT, int W, int S, bool CM = false, bool PAGED = false>
__global__ void __launch_bounds__((W + 1) * 32, 1)
    decode_tma_kernel(const Args a, const __grid_constant__ TmaMaps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Cfg = TmaConfig<T, D, DV, NT, W, S, CM>;
  constexpr int RB = NT * 8, TK = Cfg::kKeys;
  constexpr int NKC = D / 32, NVC = DV / 64;
  constexpr int EPV = 16 / sizeof(T);
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = cuda_common::align_shared_1024(smem_raw);
  unsigned char* ring = smem;
  T* Qs = reinterpret_cast<T*>(smem + Cfg::kQOff);  // [16][D], plain rows
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff);
  uint64_t* empty = full + S;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  if (tid == W * 32) prefetch_maps(maps);
  const BlockWork wk = block_work(a, RB);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  const int kvlen = wk.kvlen;
  int ks0, ks1;
  split_range<TK>(a, r0, RB, split, qlen, kvlen, &ks0, &ks1);
  const int nst = (ks1 - ks0 + TK - 1) / TK;  // stages: every split but the last is whole ones

  const int32_t* table = PAGED ? a.pages + static_cast<int64_t>(b) * a.pages_per_seq : nullptr;
  // paged: the pages of the next stage's tiles, looked up one stage early (by the producer
  // thread) so that the table loads overlap its wait for a free stage.
  [[maybe_unused]] int ahead[W];
  auto look_up = [&](int key) {
#pragma unroll
    for (int u = 0; u < W; ++u) {
      const int j = key + u * kTileKeys;
      ahead[u] = j < ks1 ? table[j / a.page_size] : -1;
    }
  };
  if (PAGED && tid == W * 32) look_up(ks0);
  // One 16-key tile of K and V of every consumer warp a stage: one copy each (chunked:
  // one a 64-wide chunk); paged: one copy each warp's tile (and chunk).
  auto issue = [&](int s, uint64_t* bar, int key) {
    unsigned char* st = ring + s * Cfg::kStageBytes;
    int c2, c3, c4;
    if constexpr (PAGED) {
      int page[W];
#pragma unroll
      for (int u = 0; u < W; ++u) page[u] = cuda_common::checked_page(ahead[u], a.num_pages);
      look_up(key + TK);
#pragma unroll
      for (int u = 0; u < W; ++u) {
        const int j = key + u * kTileKeys;
        tma_coords(maps, kvh, j % a.page_size, page[u] >= 0 ? page[u] : a.num_pages, c2, c3, c4);
        if constexpr (Cfg::kChunked) {
#pragma unroll
          for (int c = 0; c < D / 64; ++c)
            tma_load_5d(st + c * (TK * 128) + warp_tile_base<T, D>(u), &maps.k, bar, 0, c, c2,
                        c3, c4);
#pragma unroll
          for (int c = 0; c < DV / 64; ++c)
            tma_load_5d(st + Cfg::kKBytes + c * (TK * 128) + warp_tile_base<T, DV>(u), &maps.v,
                        bar, 0, c, c2, c3, c4);
        } else {
          tma_load_5d(st + warp_tile_base<T, D>(u), &maps.k, bar, 0, 0, c2, c3, c4);
          tma_load_5d(st + Cfg::kKBytes + warp_tile_base<T, DV>(u), &maps.v, bar, 0, 0, c2, c3,
                      c4);
        }
      }
    } else {
      tma_coords(maps, kvh, key, b, c2, c3, c4);
      if constexpr (Cfg::kChunked) {
        issue_chunk_tiles<D, DV>(st, Cfg::kKBytes, TK * 128, maps, bar, c2, c3, c4);
      } else {
        tma_load_5d(st, &maps.k, bar, 0, 0, c2, c3, c4);
        tma_load_5d(st + Cfg::kKBytes, &maps.v, bar, 0, 0, c2, c3, c4);
      }
    }
  };
  const uint32_t stage_bytes = static_cast<uint32_t>(Cfg::kStageBytes);
  if (tid == W * 32) start_ring<S>(full, empty, W, stage_bytes, nst, ks0, TK, issue);
  // Q rows of the block -> smem (zeros past the group / chunk), by the consumer warps,
  // while the first stages are in flight.
  if (w < W) load_q_rows<T, D, D, 16, RB, W * 32>(Qs, a, b, kvh, r0, tid);
  __syncthreads();

  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  float acc[NVC][4][NT][4];
  fill_zero(acc);

  if (w == W) {
    // Producer: one thread keeps the ring full (a stage is refilled once all W
    // consumers have released it).
    if (lane == 0)
      produce_stages<S>(full, empty, stage_bytes, S, nst, ks0, TK, issue);
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
      qb[c] = NT == 2 ? *reinterpret_cast<const uint4*>(Qs + (g + 8) * D + d)
                      : make_uint4(0, 0, 0, 0);
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
      const int j0 = ks0 + it * TK + kTileKeys * w;
      // paged: is the tile's page placed? (looked up before the wait, which hides the load)
      [[maybe_unused]] bool placed = true;
      if constexpr (PAGED)
        placed = j0 < ks1 &&
                 cuda_common::checked_page(table[j0 / a.page_size], a.num_pages) >= 0;
      mbar_wait(&full[s], (it / S) & 1);
      const unsigned char* Kt = ring + s * Cfg::kStageBytes + warp_tile_base<T, D>(w);
      unsigned char* Vt = ring + s * Cfg::kStageBytes + Cfg::kKBytes + warp_tile_base<T, DV>(w);
      if (j0 < ks1) {
        if (j0 + kTileKeys > ks1) {
          // Keys past the union of the rows' ranges: their scores are masked, but a
          // fixed-size cache may hold NaN / inf there and 0 * NaN is NaN: zero V's rows
          // (whole rows: the swizzle only moves chunks within a row's lines).
          constexpr int RC = DV * sizeof(T) / 16;  // 16-byte chunks a row
          for (int idx = lane; idx < kTileKeys * RC; idx += 32) {
            const int row = idx / RC;
            if (j0 + row >= ks1) {
              // (Chunked: the row's own lines in the chunk tiles.)
              if constexpr (Cfg::kChunked)
                *reinterpret_cast<uint4*>(Vt + kv_offset<DV, TK>(row, idx % RC)) =
                    make_uint4(0, 0, 0, 0);
              else
                *reinterpret_cast<uint4*>(Vt + idx * 16) = make_uint4(0, 0, 0, 0);
            }
          }
          fence_proxy_async_smem();  // before TMA refills this stage
          __syncwarp();
        }

        // decode_tc_kernel's math (tc_tile_step) on swizzled, permuted fragment addresses.
        auto qk = [&](int c, uint4& qa_, uint4& qb_, uint4& k0, uint4& k1) {
          const int f = qk_chunk<D>(c, t);
          qa_ = qa[c];
          qb_ = qb[c];
          k0 = *reinterpret_cast<const uint4*>(Kt + kv_offset<D, TK>(krow0, f));
          k1 = *reinterpret_cast<const uint4*>(Kt + kv_offset<D, TK>(krow1, f));
        };
        auto key = [&](int n, int e1) {
          if constexpr (PAGED) return placed ? j0 + srow[n][e1] : -1;  // -1: before first
          return j0 + srow[n][e1];
        };
        // Thread (g, t) reads dv chunk pv_chunk(c, g) of the rows behind keys 2t, 2t+1,
        // 2t+8, 2t+9: m-tile j's rows g / g+8 are dv 8 pv_chunk + 2j / +1.
        auto pv = [&](int c, uint4& v0, uint4& v1, uint4& v2, uint4& v3) {
          const int h = pv_chunk<DV>(c, g);
          v0 = *reinterpret_cast<const uint4*>(Vt + kv_offset<DV, TK>(vrow0, h));
          v1 = *reinterpret_cast<const uint4*>(Vt + kv_offset<DV, TK>(vrow1, h));
          v2 = *reinterpret_cast<const uint4*>(Vt + kv_offset<DV, TK>(vrow2, h));
          v3 = *reinterpret_cast<const uint4*>(Vt + kv_offset<DV, TK>(vrow3, h));
        };
        tc_tile_step<T, D, DV, NT>(a, rowA, rowB, qk, key, pv, mA, mB, lA, lB, acc);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);  // the stage may be refilled
    }
    tc_quad_sums<NT>(lA, lB);
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
  if constexpr (CM)
    cluster_finish<T, DV, W, 1>(a, red, red + Cfg::kRedBytes / sizeof(float), RB, b, kvh, r0,
                                qlen);
  else
    block_finish<T, DV, W, 1>(a, red, RB, b, kvh, r0, split, qlen);
#else
  __trap();  // sm_90+ only: the host never selects it below (decode_attention.cu)
#endif
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
