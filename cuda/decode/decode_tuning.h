// The decode family's tuning table: every tile choice and threshold of the default plan
// (make_plan, decode_attention.cu), one row each with its reason and the results file it
// came from. Results are one H200's (benchmarks/results/h200/decode_tuning/, GB/s of q, k,
// v and out read once, K dependent calls in one jit) unless a row says otherwise. Variants
// a sweep can pick instead are built with -DJAX_SDPA_TUNING=ON (decode_kernels.h).
#pragma once

#include <cstdint>

namespace jax_sdpa {
namespace cuda_decode {
namespace tuning {

// A kernel's shape: warps (W, or NW where the warps split the head dims), ring stages (S),
// stages a consumer step (KT, the wide TMA kernel).
struct Shape {
  int warps, stages, step_tiles;
};

// decode_tc_kernel's K/V copies ask the L2 for whole 128-byte lines (cp.async .L2::128B).
// none / 128 / 256 bytes: B8 Lk8192 D128 3219 / 3306 / 3107, B1 Lk32768 2739 / 2786 / 2632,
// B64 Lk2048 3541 / 3648 / 3402, D512 B1 1860 / 1872 / 1818; fp32 B8 Lk8192 D128
// 3448 / 3525 / - (sweep_20261130T1339.json, sweep_20261130T1348.json): so fp32 too.
constexpr int kTcPrefetch = 128;

// decode_tc_kernel: W warps per block x S stages of one 16-key tile of K and V per warp.
// D + Dv <= 256 (9.3 KB a stage): W4 S2, 81 KB, 2 blocks/SM; <= 512: W4 S1, 80 KB, 2 blocks;
// D512 (34 KB a stage): W4 S1, 150 KB, 1 block. Four warps with no copy in flight beat
// three with one (W3 S2) at D512: 47.4 vs 50.6 us a call at B1 H32/KV4 Lk8192
// (profile_20261130_run5.json, profile_20261130T1405.json).
// D = Dv = 64 takes W8 S2 (H100, benchmarks/results/h100/paged_sweep_cp_async.json, us a call):
// B8 H32/KV8 Lk8192 fp16 with lengths, paged (page 16) 72.2 -> 59.9 (W4 S3 75.4, W4 S4
// 74.1, W8 S3 61.0, W16 S2 63.4), contiguous 61.7 -> 57.8.
template <int D, int DV>
constexpr int kTcWarps = (D == 64 && DV == 64) ? 8 : 4;
template <int D, int DV>
constexpr int kTcStages = (D + DV <= 256) ? 2 : 1;

// 16-bit D = Dv = 512 where the TMA kernels can't run: decode_wide_kernel (the warps split
// the head dims), NW4 S3: B1 H32/KV4 Lk8192 bf16 31.7 vs 36.4 us a call with
// decode_tc_kernel, fp16 Lk1024 14.5 vs 16.0 (sweep_20261130T1359.json).
constexpr Shape kWide{4, 3, 0};

// decode_tma_kernel, 16-bit D = Dv = 128 (8 rows a block, sm_90+): S2 with W8 while the
// units leave SMs idle, W4 once they fill them (two blocks an SM beat W8's one):
// decode_tc_kernel -> TMA: B8 H32/KV8 Lk8192 3323 -> 3592 (W8), B1 Lk32768 2784 -> 2965
// (W8), B64 Lk2048 3661 -> 4006 (W4) (sweep_20261130T1514.json). Not at 16 rows a block:
// 174.6 us where cuDNN took 113.2 (crossover_20261130T1522.json).
constexpr Shape kTma128Sparse{8, 2, 0};
constexpr Shape kTma128Filled{4, 2, 0};

// decode_tma_kernel, D = Dv = 256: W4 S3 (201 KB, one block an SM): B1 H32/KV8 Lk8192 2400
// (W4 S2 2373, W6 S2 2309, W2 S4 2120, decode_tc_kernel 2328); B16 Lk4096 4029 (W4 S2 4023,
// decode_tc_kernel 3516) (sweep_20261130T1954.json).
constexpr Shape kTma256{4, 3, 0};

// decode_wide_tma_kernel, 16-bit D = Dv = 512: NW4 consumer warps, S6 stages of 16 keys,
// KT2 stages a consumer step (sweep_20261130T1702.json).
constexpr Shape kWideTma{4, 6, 2};

// The TMA kernels' tensor maps fetch 128-byte L2 lines. 256 / 128 / none, W8 S3: B8 Lk8192
// 3386 / 3589 / 3570, B1 Lk32768 2862 / 2950 / 2958, B64 Lk2048 3670 / 3855 / 3849
// (sweep_20261130T1513.json).
constexpr int kTmaL2Bytes = 128;

// fp32 D = Dv = 512: decode_wide_f32_kernel, NW8 S3 (S2 where its 202 KB don't fit):
// B1 H32/KV4 Lk8192 2258 GB/s (S2 2129) where decode_simt_kernel streamed 1374
// (sweep_20261130T1818.json).
constexpr Shape kWideF32[] = {{8, 3, 0}, {8, 2, 0}};

// Paged decode on an H200 (DeviceFacts::h200; other devices keep the shapes above), rows of
// 8 query rows a block: at D = Dv = 128 where the TMA kernel's grid leaves SMs idle
// (kTma128Sparse's case), the cp.async kernel in W8 S2: B8 H32/KV8 Lk8192 page 64 3149-3182
// -> 3431-3481 GB/s, B1 Lk32768 page 16 2761-2806 -> 2882-2886; filled grids keep the TMA
// kernel (B64 Lk2048 page 16 3934 against 3637). D = Dv = 64: W16 S2, B8 Lk8192 fp16 page 16
// 2662-2691 -> 2847-2903 (h200/paged_sweep_20261207.json, three runs). On an H100 the
// defaults win the same rows: 2747 against 2650, 2359 against 2270, 2271 against 2202
// (h100/paged_sweep_20261207T1249.json).
constexpr Shape kPagedH200Sparse128{8, 2, 0};
constexpr Shape kPagedH200D64{16, 2, 0};

// Least K + V bytes a split takes: enough to amortize a block's start and its partial.
// 64 KiB against 32: B1 H32/KV4 Lk8192 D512 bf16 (decode_wide_kernel NW4 S4) 32.5 vs 32.6 us
// a call, fp16 Lk1024 14.5 vs 14.8 (NW8 S4: 15.2 vs 15.1) (sweep_20261130T1359.json): no
// gain from smaller splits; larger ones not measured.
constexpr int kMinSplitKiB = 64;

// Query rows (GQA group x queries) above which a 16-bit call with Dv <= 256 takes 16 rows a
// block (one m16 tile of the tensor-core kernels) instead of 8: a group of more than 8 rows
// then reads each K/V tile once. Not swept against two 8-row blocks (no results file); the
// TMA kernel stays at 8 rows (kTma128Sparse above).
constexpr int64_t kSixteenRowsAbove = 8;

// The splits of a unit merge in a thread-block cluster (behind decode_tma_kernel) at up to
// this many splits: at 2 it beat the combine kernel (B8 H32/KV8 Lk8192 D128 3823 vs 3736,
// sweep_20261130T1843.json), at 16 it lost (B1 H32/KV8 Lk8192 D256 2400 vs 2492,
// sweep_20261130T1954.json); between: not measured.
constexpr int kAutoClusterSplits = 8;

// The fused combine (the last split block merges) while a thread's loads stay under this;
// past it a grid-wide combine kernel is shorter. Never behind decode_tma_kernel: the
// combine kernel was faster there (B8 Lk8192 D128 3717 vs 3608 fused,
// sweep_20261130T1634.json).
constexpr int kFusedCombineMaxLoads = 48;

}  // namespace tuning
}  // namespace cuda_decode
}  // namespace jax_sdpa
