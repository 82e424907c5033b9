// Our CUDA decode kernels (few queries per kv head: Lq * Hq/Hk small), host API.
//
// Split-K flash decoding: one block per (batch, kv head, row chunk, key split)
// with every query row of the GQA group packed into the block so that each K/V
// row is read from HBM once per kv head; per-split partial out + lse go to
// the workspace and a combine kernel merges them (one pass when B*Hk fills the GPU).
// bf16/fp16 run on tensor cores (mma.sync m16n8k16, f32 accumulation); fp32
// runs on the CUDA cores in full fp32. Semantics: docs/ffi_contract.md.
//
// Plain C++ (no CUDA headers beyond the runtime API) so that the FFI handler,
// compiled by the host compiler, can include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_decode {

// The workspace: a uint8 result buffer of the FFI call (the third result of
// `jax_sdpa_cuda_fwd`, allocated by XLA, so that the handler needs no scratch
// allocator and XLA can capture the call in a command buffer). For n splits and
// rows = B * Hq * Lq, byte offsets from its (16-byte aligned) start:
//   [partial out: n * rows * Dv float32, padded to 256 bytes]
//   [partial lse: n * rows float32, padded to 256 bytes]
//   [combine counters: units int32, padded to 256 bytes]   (fused combine only)
// units = B * Hk * row_chunks, row_chunks = ceil(G * Lq / rows_per_block). One
// split needs none of it; the separate combine kernel needs no counters. The
// lowering sizes it with workspace_bytes (below, bound to Python) for the largest split
// count the heuristic can choose; make_plan lowers the split count to what fits when it
// is smaller (e.g. a pinned split count).
constexpr size_t kWorkspaceAlign = 256;

struct WorkspaceLayout {
  size_t part_o = 0;    // byte offsets of the three regions
  size_t part_lse = 0;
  size_t counters = 0;
  size_t bytes = 0;     // bytes used: 0 when num_splits == 1
};

// The layout for `num_splits` splits over `units` block units; `fused`: counters too.
WorkspaceLayout workspace_layout(const SdpaParams& p, int num_splits, int64_t units, bool fused);

// A kernel variant: what a call asks for (per-call knobs below; zeros / -1 / false:
// the default for the dims) and, in a plan, what it runs.
struct KernelVariant {
  int warps = 0, stages = 0;  // W x S (decode_tc_kernel) or NW x S (decode_wide_kernel)
  int prefetch = -1;          // L2 mode of the K/V copies: 0, 128, 256 bytes of prefetch,
                              // or 128 + kEvictFirst (132)
  bool wide = false;          // decode_wide_kernel: the warps split the head dims
  bool tma = false;           // decode_tma_kernel (sm_90+): W consumer warps, S block-wide stages
  int step_tiles = 0;         // decode_wide_tma_kernel (wide && tma): 16-key tiles a step
  bool cluster = false;       // decode_tma_kernel: the splits of a unit merge in a cluster
  bool paged = false;         // decode_tc_kernel reading paged K/V through the page table
  bool operator==(const KernelVariant& o) const {
    return warps == o.warps && stages == o.stages && prefetch == o.prefetch && wide == o.wide &&
           tma == o.tma && step_tiles == o.step_tiles && cluster == o.cluster &&
           paged == o.paged;
  }
};

// How one call will run: decided on the host from shapes, the device and the workspace.
struct DecodePlan {
  int num_splits = 1;       // key splits per (b, kv head, row chunk)
  int rows_per_block = 8;   // query rows (GQA heads x queries) per block: 8 or 16
  int row_chunks = 1;       // ceil(Lq * G / rows_per_block)
  int blocks_per_sm = 1;    // occupancy of the main kernel
  int num_sms = 1;
  bool tensor_cores = false;
  KernelVariant kernel;        // the main kernel
  bool fused_combine = false;  // last split block merges (no combine launch)
  // (kernel.cluster: the splits of a unit merge in a thread-block cluster, no combine
  // launch; the partials' workspace stays reserved for the cp.async fallback.)
  WorkspaceLayout workspace;   // where the partials / counters go (bytes <= workspace given)
  int tma_l2 = 128;            // TMA kernels: their tensor maps' L2 fetch bytes
};

// Empty when our kernels can serve `p`, else why not (shown to the user).
std::string unsupported_reason(const SdpaParams& p);

// Empty when our decode kernels read the pages of a paged call of these shapes in place
// (16-bit, D = Dv in kPagedHeadDim of decode_kernels.h), else why not. The paged target runs
// them for calls without a feature (soft cap), the flash forward's feature kernel for the
// rest.
std::string paged_unsupported_reason(const SdpaParams& p);

// The (D, Dv) pairs the kernels are built for.
std::vector<std::pair<int, int>> built_head_dims();

// Bytes of the workspace result for `p`'s shapes (>= 256, never empty): the layout above
// for the most splits make_plan can choose on any device.
size_t workspace_bytes(const SdpaParams& p);

// The kernel make_plan runs for `p` by default on an sm_90+ GPU ("" where the dims are not
// built): decode_tma_kernel, decode_wide_tma_kernel, decode_tc_kernel, decode_wide_kernel,
// decode_simt_kernel or decode_wide_f32_kernel.
const char* default_kernel_name(const SdpaParams& p);

// Chooses splits / rows per block for the current device. The split count is lowered
// until the partials fit in `workspace_bytes` (1 split needs none), and the fused combine
// becomes the separate kernel when its counters do not fit. Returns a CUDA error on
// failure. Plans are cached by the call's shapes, strides and flags, the workspace size,
// the device and the environment overrides below (a changed setting makes a new plan, so
// one process can time several settings, one executable each; docs/cuda_decode.md):
//   JAX_SDPA_CUDA_DECODE_SPLITS=n     split count (0 / unset: the heuristic)
//   JAX_SDPA_CUDA_DECODE_COMBINE=auto|fused|kernel|cluster   how split partials merge
//                                     (auto: in a thread-block cluster behind
//                                     decode_tma_kernel at 2..8 splits where the clusters fit
//                                     one wave (cluster: up to 16); else fused when the last block's merge is
//                                     short, else a kernel)
//   JAX_SDPA_CUDA_DECODE_CFG=W,S      tensor-core warps x ring stages, where built
//   JAX_SDPA_CUDA_DECODE_L2=0|128|256|132  L2 mode of the K/V copies, where built (unset:
//                                     128; 132: 128 with the lines marked evict-first)
//   JAX_SDPA_CUDA_DECODE_WIDE=NW,S|off  the wide-head kernel (D = Dv in {256, 512}, <= 8
//                                     rows a block): NW warps splitting the head dims, S
//                                     stages; on fp32 (D = Dv = 512: the default there, NW8
//                                     S3) decode_wide_f32_kernel; off: never
//   JAX_SDPA_CUDA_DECODE_TMA=W,S|off  decode_tma_kernel (sm_90+, 16-bit D = Dv in {128,
//                                     256}; the default there): W consumer warps, S stages of 16 W
//                                     keys; off: never
//   JAX_SDPA_CUDA_DECODE_TMA_L2=n     its tensor maps' L2 fetch bytes (0, 64, 128, 256)
//   JAX_SDPA_CUDA_DECODE_WIDE_TMA=NW,S,KT|off  decode_wide_tma_kernel (sm_90+, 16-bit
//                                     D = Dv = 512; the default there; D256 variants): NW
//                                     consumer warps, S stages of 16 keys, KT stages a step
//   JAX_SDPA_CUDA_DECODE_MIN_SPLIT_KB=k  least K+V bytes per split (heuristic)
//   JAX_SDPA_CUDA_DECODE_VERBOSE=1    print each new plan to stderr
// Only device-attribute / occupancy queries: nothing synchronous, no allocation
// (safe while XLA captures the stream into a CUDA graph).
cudaError_t make_plan(const SdpaParams& p, int device, size_t workspace_bytes,
                      DecodePlan* plan);

// Enqueues the kernels on `stream` (stream work only: a cudaMemsetAsync of the
// counters when the combine is fused, the main kernel, the combine kernel).
// `workspace` (16-byte aligned, `workspace_bytes` long) must hold
// plan.workspace.bytes.
cudaError_t launch(const SdpaParams& p, const SdpaFwdBuffers& buf, const DecodePlan& plan,
                   void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace cuda_decode
}  // namespace jax_sdpa
