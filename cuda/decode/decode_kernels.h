// Internal to cuda/decode_attention*.cu: kernel descriptors and per-dtype
// selectors, so that the three dtypes' instantiations compile in parallel
// (decode_attention.cu: fp32 + host logic, decode_attention_f16.cu, _bf16.cu).
#pragma once

#include <cstdint>

#include <type_traits>

#include "ffi/tuning_knobs.h"
#include "cuda/decode/decode_attention.h"
#include "cuda/decode/decode_combine.cuh"
#include "cuda/decode/decode_simt.cuh"
#include "cuda/decode/decode_tc.cuh"
#include "cuda/decode/decode_tuning.h"
#include "cuda/decode/decode_tma.cuh"
#include "cuda/decode/decode_wide.cuh"
#include "cuda/decode/decode_wide_f32.cuh"
#include "cuda/decode/decode_wide_tma.cuh"

namespace jax_sdpa {
namespace cuda_decode {

// (D, Dv) pairs we instantiate (a test build may define a shorter list).
#ifndef JAX_SDPA_DECODE_DIMS
#define JAX_SDPA_DECODE_DIMS(X) \
  X(64, 64)                     \
  X(72, 72)                     \
  X(80, 80)                     \
  X(96, 96)                     \
  X(128, 128)                   \
  X(192, 192)                   \
  X(256, 256)                   \
  X(512, 512)                   \
  X(192, 128)                   \
  X(96, 64)
#endif

struct KernelInfo {
  const void* func = nullptr;
  // The launch; a TMA kernel (tma_box_keys > 0) takes the call's K / V tensor maps.
  cudaError_t (*launch)(const Args&, const TmaMaps*, dim3, int, size_t, cudaStream_t) = nullptr;
  void (*combine)(const Args&, dim3, cudaStream_t) = nullptr;
  int threads = 0;
  size_t smem = 0;
  bool tensor_cores = false;
  KernelVariant variant;  // what it is (W, S for the split heuristic and reports)
  int tma_box_keys = 0;          // TMA kernels: keys a box of their tensor maps
  bool tma_chunk_boxes = false;  // ... and one 64-wide chunk a box (encode_kv_maps)
};

// Null func when (d, dv) is not built. rows16: 16 query rows per block. A variant that
// is not built for the dims gives the default.
KernelInfo select_f32(int64_t d, int64_t dv, const KernelVariant& want);
KernelInfo select_f16(int64_t d, int64_t dv, bool rows16, const KernelVariant& want);
KernelInfo select_bf16(int64_t d, int64_t dv, bool rows16, const KernelVariant& want);

// Separate split-K combine: one thread per (output row, 4 dv); 128 threads a block.
template <typename T, int DV>
void launch_combine(const Args& a, dim3 grid, cudaStream_t st) {
  combine_kernel<T, DV><<<grid, 128, 0, st>>>(a);
}

// The descriptor of one instantiated main kernel (storage type T, Dv for its combine),
// launched by `launch`.
template <typename T, int DV>
KernelInfo describe(const void* func, decltype(KernelInfo::launch) launch, int threads,
                    size_t smem, bool tensor_cores, KernelVariant variant) {
  KernelInfo k;
  k.func = func;
  k.launch = launch;
  k.combine = &launch_combine<T, DV>;
  k.threads = threads;
  k.smem = smem;
  k.tensor_cores = tensor_cores;
  k.variant = variant;
  return k;
}

// ... for a kernel that takes the call's Args only.
template <auto Kernel, typename T, int DV>
KernelInfo kernel_info(int threads, size_t smem, bool tensor_cores, KernelVariant variant) {
  return describe<T, DV>(
      reinterpret_cast<const void*>(Kernel),
      [](const Args& a, const TmaMaps*, dim3 grid, int threads, size_t smem, cudaStream_t st) {
        Kernel<<<grid, threads, smem, st>>>(a);
        return cudaGetLastError();
      },
      threads, smem, tensor_cores, variant);
}

template <typename T, int D, int DV, int NT, int W, int S, int PF>
KernelInfo tc_info() {
  using Cfg = TcConfig<T, D, DV, NT, W, S>;
  static_assert(Cfg::kSmem + 64 <= 227 * 1024, "decode_tc_kernel: too much shared memory");
  return kernel_info<&decode_tc_kernel<T, D, DV, NT, W, S, PF>, T, DV>(
      Cfg::kThreads, Cfg::kSmem, true, KernelVariant{W, S, PF, false});
}

// The L2 prefetch of the tensor-core kernels' copies (decode_tuning.h). Tuning builds also
// build variants without the hint and with 256 bytes for the dims below, picked per call
// with JAX_SDPA_CUDA_DECODE_L2=0|256|132 (132: 128 with the lines marked evict-first).
constexpr int kTcPrefetch = tuning::kTcPrefetch;
template <int D, int DV>
constexpr bool kPrefetchBuilt = (D == 128 && DV == 128) || (D == 512 && DV == 512);

// decode_tc_kernel's warps per block (W) and per-warp ring depth (S) (decode_tuning.h).
// Tuning builds add variants (JAX_SDPA_CUDA_DECODE_CFG=W,S) at D = Dv = 128 and 512.
template <int D, int DV>
struct TcDefault {
  static constexpr int W = tuning::kTcWarps<D, DV>;
  static constexpr int S = tuning::kTcStages<D, DV>;
};

// The K and V tensor maps of the TMA kernels: 5-D (64 elements, D / 64 chunks, then kv
// head, key and batch ordered by stride), boxes of box_keys keys and all the chunks
// (decode_tma_kernel) or one chunk (chunk_boxes: decode_wide_tma_kernel, one copy per
// chunk), 128-byte swizzle, zeros past the tensor, l2_bytes the L2 fetch size (0, 64,
// 128, 256). Any pointer works for a trial (plan time: can these strides be mapped?).
cudaError_t encode_kv_maps(const void* k, const void* v, const int64_t (&ks)[3],
                           const int64_t (&vs)[3], int B, int Hk, int Lk, bool bf16, int d, int dv,
                           int box_keys, bool chunk_boxes, int l2_bytes, TmaMaps* maps);

// The launch of a cluster-merge kernel (cluster_finish): the grid's splits (gridDim.y)
// are one thread-block cluster per unit. `attr` holds the cluster attribute cfg points to.
inline cudaLaunchConfig_t cluster_launch_config(dim3 grid, int threads, size_t smem,
                                                cudaStream_t st, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 1;
  attr->val.clusterDim.y = grid.y;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// A TMA kernel's launch with the call's maps (launch() encodes them, or reuses the
// last encoding of the same pointers and shapes). CM: launched as clusters
// (cluster_launch_config).
template <auto Kernel, bool CM = false>
cudaError_t launch_with_maps(const Args& a, const TmaMaps* maps, dim3 grid, int threads,
                             size_t smem, cudaStream_t st) {
  if (maps == nullptr) return cudaErrorInvalidValue;
  if constexpr (CM) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_launch_config(grid, threads, smem, st, &attr);
    return cudaLaunchKernelEx(&cfg, Kernel, a, *maps);
  } else {
    Kernel<<<grid, threads, smem, st>>>(a, *maps);
    return cudaGetLastError();
  }
}

template <typename T, int D, int DV, int NT, int W, int S, bool CM = false, bool PAGED = false>
KernelInfo tma_info() {
  using Cfg = TmaConfig<T, D, DV, NT, W, S, CM>;
  static_assert(Cfg::kSmem <= 227 * 1024, "decode_tma_kernel: too much shared memory");
  constexpr auto kernel = &decode_tma_kernel<T, D, DV, NT, W, S, CM, PAGED>;
  KernelVariant v{W, S, 0, false, true};
  v.cluster = CM;
  v.paged = PAGED;
  KernelInfo k = describe<T, DV>(reinterpret_cast<const void*>(kernel),
                                 &launch_with_maps<kernel, CM>, Cfg::kThreads, Cfg::kSmem, true, v);
  // One box a stage (paged: a warp's 16-key tile), of all of D or (D256) a 64-wide chunk.
  k.tma_box_keys = PAGED ? kTileKeys : Cfg::kKeys;
  k.tma_chunk_boxes = Cfg::kChunked;
  return k;
}

// decode_tma_kernel variants (D = Dv = 128): W consumer warps x S stages of 16 W keys
// (KB of smem / blocks per SM: W4 S2 66/3, W4 S3 99/2, W4 S4 132/1, W4 S6 197/1, W8 S2
// 132/1, W8 S3 197/1, W2 S4 66/3). D = Dv = 256 (a stage is twice the bytes): W4 S2
// 137/1, W4 S3 201/1, W2 S4 137/1, W2 S6 201/1, W6 S2 201/1. Null where not built.
// cluster: the cluster-merge variant (built for the defaults: D128 W8 S2 and W4 S2, D256
// W4 S3 and W4 S2). paged: built for the defaults (and their cluster variants) only.
template <typename T, int D, int DV, int NT>
KernelInfo tma_select(int w, int s, bool cluster, bool paged) {
  if (paged) {
    if constexpr (NT == 1 && D == 128 && DV == 128) {
      if (w == 8 && s == 2)
        return cluster ? tma_info<T, D, DV, NT, 8, 2, true, true>()
                       : tma_info<T, D, DV, NT, 8, 2, false, true>();
      if (w == 4 && s == 2)
        return cluster ? tma_info<T, D, DV, NT, 4, 2, true, true>()
                       : tma_info<T, D, DV, NT, 4, 2, false, true>();
    }
    if constexpr (NT == 1 && D == 256 && DV == 256) {
      if (w == 4 && s == 3)
        return cluster ? tma_info<T, D, DV, NT, 4, 3, true, true>()
                       : tma_info<T, D, DV, NT, 4, 3, false, true>();
    }
    return KernelInfo{};
  }
  if constexpr (D == 256 && DV == 256 && NT == 1) {
    if (cluster) {
      if (w == 4 && s == 3) return tma_info<T, D, DV, NT, 4, 3, true>();
#if JAX_SDPA_TUNING
      if (w == 4 && s == 2) return tma_info<T, D, DV, NT, 4, 2, true>();
#endif
      return KernelInfo{};
    }
    if (w == 4 && s == 3) return tma_info<T, D, DV, NT, 4, 3>();
#if JAX_SDPA_TUNING
    if (w == 4 && s == 2) return tma_info<T, D, DV, NT, 4, 2>();
    if (w == 2 && s == 4) return tma_info<T, D, DV, NT, 2, 4>();
    if (w == 2 && s == 6) return tma_info<T, D, DV, NT, 2, 6>();
    if (w == 6 && s == 2) return tma_info<T, D, DV, NT, 6, 2>();
#endif
  }
  if constexpr (D == 128 && DV == 128) {
    if (cluster) {
      if (w == 8 && s == 2) return tma_info<T, D, DV, NT, 8, 2, true>();
      if (w == 4 && s == 2) return tma_info<T, D, DV, NT, 4, 2, true>();
      return KernelInfo{};
    }
    if (w == 4 && s == 2) return tma_info<T, D, DV, NT, 4, 2>();
    if (w == 8 && s == 2) return tma_info<T, D, DV, NT, 8, 2>();
#if JAX_SDPA_TUNING
    if (w == 4 && s == 3) return tma_info<T, D, DV, NT, 4, 3>();
    if (w == 4 && s == 4) return tma_info<T, D, DV, NT, 4, 4>();
    if (w == 4 && s == 6) return tma_info<T, D, DV, NT, 4, 6>();
    if (w == 8 && s == 3) return tma_info<T, D, DV, NT, 8, 3>();
    if (w == 2 && s == 4) return tma_info<T, D, DV, NT, 2, 4>();
#endif
  }
  return KernelInfo{};
}

template <typename T, int D, int DV, int NW, int S, int KT>
KernelInfo wide_tma_info() {
  using Cfg = WideTmaConfig<T, D, DV, NW, S, KT>;
  static_assert(Cfg::kSmem <= 227 * 1024, "decode_wide_tma_kernel: too much shared memory");
  constexpr auto kernel = &decode_wide_tma_kernel<T, D, DV, NW, S, KT>;
  KernelInfo k = describe<T, DV>(reinterpret_cast<const void*>(kernel), &launch_with_maps<kernel>,
                                 Cfg::kThreads, Cfg::kSmem, true,
                                 KernelVariant{NW, S, 0, true, true, KT});
  k.tma_box_keys = kTileKeys;  // one box a 64-wide chunk of a stage
  k.tma_chunk_boxes = true;
  return k;
}

// decode_wide_tma_kernel variants: NW consumer warps x S stages of 16 keys, KT stages a
// consumer step (KB of smem / blocks per SM: D512 NW4 S6 198-213/1, NW4 S4 KT2 141/1,
// NW8 S6 KT2 213/1). Null where not built. (At D256 it lost to decode_tc_kernel:
// docs/tried.md.)
template <typename T, int D, int DV>
KernelInfo wide_tma_select(int nw, int s, int kt) {
  if constexpr (D == DV && D == 512) {
    if (nw == 4 && s == 6 && kt == 2) return wide_tma_info<T, D, DV, 4, 6, 2>();
#if JAX_SDPA_TUNING
    if (nw == 4 && s == 6 && kt == 1) return wide_tma_info<T, D, DV, 4, 6, 1>();
    if (nw == 4 && s == 6 && kt == 3) return wide_tma_info<T, D, DV, 4, 6, 3>();
    if (nw == 4 && s == 4 && kt == 2) return wide_tma_info<T, D, DV, 4, 4, 2>();
    if (nw == 8 && s == 6 && kt == 2) return wide_tma_info<T, D, DV, 8, 6, 2>();
#endif
  }
  return KernelInfo{};
}

template <typename T, int D, int DV, int NW, int S, int PF = kTcPrefetch>
KernelInfo wide_info() {
  using Cfg = WideConfig<T, D, DV, NW, S>;
  static_assert(Cfg::kSmem + 64 <= 227 * 1024, "decode_wide_kernel: too much shared memory");
  return kernel_info<&decode_wide_kernel<T, D, DV, NW, S, PF>, T, DV>(
      Cfg::kThreads, Cfg::kSmem, true, KernelVariant{NW, S, PF, true});
}

// decode_wide_kernel variants: D = Dv in {256, 512}; NW 4 (D512 also 8); S 3 or 4
// (D512 NW4 S4: 147 KB, 1 block/SM; D256 NW4 S4: 77 KB, 2 blocks/SM).
template <typename T, int D, int DV>
KernelInfo wide_select(int nw, int s) {
#if JAX_SDPA_TUNING
  if constexpr (D == DV && (D == 256 || D == 512)) {
    if (nw == 4 && s == 3) return wide_info<T, D, DV, 4, 3>();
    if (nw == 4 && s == 4) return wide_info<T, D, DV, 4, 4>();
    if constexpr (D == 512) {
      if (nw == 8 && s == 3) return wide_info<T, D, DV, 8, 3>();
      if (nw == 8 && s == 4) return wide_info<T, D, DV, 8, 4>();
    }
  }
#else
  (void)nw;
  (void)s;
#endif
  return KernelInfo{};
}

// decode_tc_kernel over paged K/V, in its default shape (W, S as TcDefault) and the H200's
// (decode_tuning.h): built for the head dims of kPagedHeadDim. Tuning builds add W,S
// variants (JAX_SDPA_CUDA_DECODE_CFG).
template <int D, int DV>
constexpr bool kPagedHeadDim = D == DV && (D == 64 || D == 128 || D == 256);

template <typename T, int D, int DV, int NT, int W, int S>
KernelInfo tc_paged_info() {
  using Cfg = TcConfig<T, D, DV, NT, W, S>;
  KernelVariant v{W, S, kTcPrefetch, false};
  v.paged = true;
  return kernel_info<&decode_tc_kernel<T, D, DV, NT, W, S, kTcPrefetch, true>, T, DV>(
      Cfg::kThreads, Cfg::kSmem, true, v);
}

template <typename T, int D, int DV, int NT, int W, int S>
constexpr bool kTcFits = TcConfig<T, D, DV, NT, W, S>::kSmem + 64 <= 227 * 1024;

template <typename T, int D, int DV, int NT>
KernelInfo tc_paged_select(int w, int s) {
  // The H200's paged shapes (decode_tuning.h), in every build.
  constexpr tuning::Shape h200 = D == 64 ? tuning::kPagedH200D64 : tuning::kPagedH200Sparse128;
  if constexpr (NT == 1 && (D == 64 || D == 128) && kTcFits<T, D, DV, NT, h200.warps, h200.stages>)
    if (w == h200.warps && s == h200.stages)
      return tc_paged_info<T, D, DV, NT, h200.warps, h200.stages>();
#if JAX_SDPA_TUNING
#define JAX_SDPA_PAGED_VARIANT(W, S) \
  if constexpr (kTcFits<T, D, DV, NT, W, S>) \
    if (w == W && s == S) return tc_paged_info<T, D, DV, NT, W, S>();
  JAX_SDPA_PAGED_VARIANT(4, 3)
  JAX_SDPA_PAGED_VARIANT(4, 4)
  JAX_SDPA_PAGED_VARIANT(8, 2)
  JAX_SDPA_PAGED_VARIANT(8, 3)
  JAX_SDPA_PAGED_VARIANT(8, 4)
  JAX_SDPA_PAGED_VARIANT(16, 2)
#undef JAX_SDPA_PAGED_VARIANT
#endif
  return tc_paged_info<T, D, DV, NT, TcDefault<D, DV>::W, TcDefault<D, DV>::S>();
}

template <typename T, int D, int DV, int NT>
KernelInfo tc_select(const KernelVariant& want) {
  if (want.paged) {
    if (want.tma) return tma_select<T, D, DV, NT>(want.warps, want.stages, want.cluster, true);
    if constexpr (kPagedHeadDim<D, DV>) return tc_paged_select<T, D, DV, NT>(want.warps, want.stages);
    return KernelInfo{};
  }
  int w = want.warps, s = want.stages;
  const int pf = want.prefetch;
  if (want.tma && want.wide) {  // (NW, S) name a wide TMA variant: else the default
    if constexpr (NT == 1) {
      KernelInfo k = wide_tma_select<T, D, DV>(w, s, want.step_tiles);
      if (k.func != nullptr) return k;
    }
    w = s = 0;
  } else if (want.tma) {  // (W, S) name a TMA variant: where none is built, the default
    KernelInfo k = tma_select<T, D, DV, NT>(w, s, want.cluster, false);
    if (k.func != nullptr) return k;
    w = s = 0;
  } else if (want.wide) {  // (NW, S) name a wide variant: where none is built, the default
    if constexpr (NT == 1) {
      KernelInfo k = wide_select<T, D, DV>(w, s);
      if (k.func != nullptr) return k;
    }
    w = s = 0;
  }
  if constexpr (D == 512 && DV == 512 && NT == 1) {
    // Default at D512: the wide kernel (decode_tuning.h). CFG=4,1 (or an L2 setting) still
    // reaches decode_tc_kernel.
    if (w == 0 && s == 0 && pf < 0)
      return wide_info<T, D, DV, tuning::kWide.warps, tuning::kWide.stages>();
  }
  constexpr int W0 = TcDefault<D, DV>::W, S0 = TcDefault<D, DV>::S;
#if JAX_SDPA_TUNING
  if constexpr (kPrefetchBuilt<D, DV> && NT == 1) {
    const bool dflt = (w == 0 && s == 0) || (w == W0 && s == S0);
    if (dflt && pf == 0) return tc_info<T, D, DV, NT, W0, S0, 0>();
    if (dflt && pf == 256) return tc_info<T, D, DV, NT, W0, S0, 256>();
    if (dflt && pf == 128 + kEvictFirst) return tc_info<T, D, DV, NT, W0, S0, 128 + kEvictFirst>();
    if constexpr (D == 128) {
      if (w == 8 && s == 2 && pf == 0) return tc_info<T, D, DV, NT, 8, 2, 0>();
      if (w == 8 && s == 2 && pf == 256) return tc_info<T, D, DV, NT, 8, 2, 256>();
    }
  }
  if constexpr (D == 64 && DV == 64) {
    if (w == 4 && s == 2) return tc_info<T, D, DV, NT, 4, 2, kTcPrefetch>();
    if (w == 8 && s == 3) return tc_info<T, D, DV, NT, 8, 3, kTcPrefetch>();
    if (w == 16 && s == 2) return tc_info<T, D, DV, NT, 16, 2, kTcPrefetch>();
  }
  if constexpr (D == 128 && DV == 128) {
    // smem (KB) / blocks per SM: W2S4 81/2, W3S3 90/2, W2S5 100/2, W4S3 119/1, W4S4 157/1,
    // W8S2 157/1.
    if (w == 2 && s == 4) return tc_info<T, D, DV, NT, 2, 4, kTcPrefetch>();
    if (w == 3 && s == 3) return tc_info<T, D, DV, NT, 3, 3, kTcPrefetch>();
    if (w == 2 && s == 5) return tc_info<T, D, DV, NT, 2, 5, kTcPrefetch>();
    if (w == 4 && s == 3) return tc_info<T, D, DV, NT, 4, 3, kTcPrefetch>();
    if (w == 4 && s == 4) return tc_info<T, D, DV, NT, 4, 4, kTcPrefetch>();
    if (w == 8 && s == 2) return tc_info<T, D, DV, NT, 8, 2, kTcPrefetch>();
  }
#endif
  if constexpr (D == 512 && DV == 512) {
    // smem (KB) / blocks per SM: W3S2 217/1, W2S2 150/1, W2S3 217/1. W2S2 is make_plan's
    // fallback where 150 KB is what fits (an A100).
    if (w == 2 && s == 2) return tc_info<T, D, DV, NT, 2, 2, kTcPrefetch>();
#if JAX_SDPA_TUNING
    if (w == 3 && s == 2) return tc_info<T, D, DV, NT, 3, 2, kTcPrefetch>();
    if (w == 2 && s == 3) return tc_info<T, D, DV, NT, 2, 3, kTcPrefetch>();
#endif
  }
  return tc_info<T, D, DV, NT, W0, S0, kTcPrefetch>();
}

template <int D, int DV, int PF>
KernelInfo simt_info() {
  constexpr int W = (D + DV <= 512) ? 4 : 2;
  constexpr int S = 1;
  using Cfg = SimtConfig<D, DV, W, S>;
  return kernel_info<&decode_simt_kernel<D, DV, W, S, PF>, float, DV>(
      Cfg::kThreads, Cfg::kSmem, false, KernelVariant{W, S, PF, false});
}

// decode_wide_f32_kernel (the fp32 D = Dv = 512 default, make_plan; also
// JAX_SDPA_CUDA_DECODE_WIDE=8,3|8,2 on an fp32 call): NW8 S3 (202 KB) and S2 (137 KB),
// one block an SM.
template <int D, int DV, int NW, int S>
KernelInfo wide_f32_info() {
  using Cfg = WideF32Config<D, DV, NW, S>;
  static_assert(Cfg::kSmem + 64 <= 227 * 1024, "decode_wide_f32_kernel: too much shared memory");
  return kernel_info<&decode_wide_f32_kernel<D, DV, NW, S, kTcPrefetch>, float, DV>(
      Cfg::kThreads, Cfg::kSmem, false, KernelVariant{NW, S, kTcPrefetch, true});
}

template <int D, int DV>
KernelInfo simt_select(const KernelVariant& want) {
  const int pf = want.prefetch;
  if constexpr (D == 512 && DV == 512) {
    if (want.wide && want.warps == 8 && want.stages == 3) return wide_f32_info<D, DV, 8, 3>();
    if (want.wide && want.warps == 8 && want.stages == 2) return wide_f32_info<D, DV, 8, 2>();
  }
#if JAX_SDPA_TUNING
  if constexpr (kPrefetchBuilt<D, DV>) {
    if (pf == 0) return simt_info<D, DV, 0>();
    if (pf == 256) return simt_info<D, DV, 256>();
  }
#else
  (void)pf;
#endif
  return simt_info<D, DV, kTcPrefetch>();
}

// The 16-bit selector behind select_f16 / select_bf16 (each dtype's file instantiates it).
template <typename T>
KernelInfo select_tc(int64_t d, int64_t dv, bool rows16, const KernelVariant& want) {
#define JAX_SDPA_X(D_, DV_)                                      \
  if (d == D_ && dv == DV_) {                                    \
    if constexpr (DV_ <= 256) {                                  \
      if (rows16) return tc_select<T, D_, DV_, 2>(want);         \
    }                                                            \
    return tc_select<T, D_, DV_, 1>(want);                       \
  }
  JAX_SDPA_DECODE_DIMS(JAX_SDPA_X)
#undef JAX_SDPA_X
  return KernelInfo{};
}

}  // namespace cuda_decode
}  // namespace jax_sdpa

// The 16-bit selector `select_<suffix>` for storage type T: one translation unit each
// (decode_f16.cu, decode_bf16.cu), so that the dtypes' kernels compile in parallel.
#define JAX_SDPA_DECODE_16BIT_SELECTOR(suffix, T)                                            \
  namespace jax_sdpa::cuda_decode {                                                         \
  KernelInfo select_##suffix(int64_t d, int64_t dv, bool rows16, const KernelVariant& want) { \
    return select_tc<T>(d, dv, rows16, want);                                               \
  }                                                                                         \
  }
