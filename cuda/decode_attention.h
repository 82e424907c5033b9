// Our CUDA decode kernels (few queries per kv head: Lq * Hq/Hk small), host API.
//
// Split-K flash decoding: one block per (batch, kv head, row chunk, key split)
// with every query row of the GQA group packed into the block so that each K/V
// row is read from HBM once per kv head; per-split partial out + lse go to
// scratch and a combine kernel merges them (one pass when B*Hk fills the GPU).
// bf16/fp16 run on tensor cores (mma.sync m16n8k16, f32 accumulation); fp32
// runs on the CUDA cores in full fp32. Semantics: docs/ffi_contract.md.
//
// Plain C++ (no CUDA headers beyond the runtime API) so that the FFI handler,
// compiled by the host compiler, can include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_decode {

// How one call will run: decided on the host from shapes and the device.
struct DecodePlan {
  int num_splits = 1;       // key splits per (b, kv head, row chunk)
  int rows_per_block = 8;   // query rows (GQA heads x queries) per block: 8 or 16
  int row_chunks = 1;       // ceil(Lq * G / rows_per_block)
  int blocks_per_sm = 1;    // occupancy of the main kernel
  int num_sms = 1;
  bool tensor_cores = false;
  int warps = 0, stages = 0;   // the main kernel's W x S (tensor cores: variant chosen)
  bool fused_combine = false;  // last split block merges (no combine launch)
  int* counters = nullptr;     // the device's split counters when fused
  size_t scratch_bytes = 0; // split-K partials (0 when num_splits == 1)
  // Decode v2 draft (JAX_SDPA_CUDA_DECODE_V2=1 only; cuda/decode_v2.h): the plan
  // was sized for it too (scratch_bytes >= its partials), `v2_counters` are the
  // device's self-resetting counters for its fused combine.
  bool v2 = false;
  int* v2_counters = nullptr;
};

// Empty when our kernels can serve `p`, else why not (shown to the user).
std::string unsupported_reason(const SdpaParams& p);

// Chooses splits / rows per block for the current device. `force_splits` > 0
// overrides the heuristic (benchmarks, tests); `combine_mode` 0: default (auto:
// fused when the last block's merge is short, else a separate combine kernel),
// 1: always a separate combine kernel, 2: fused where possible. Returns a CUDA
// error on failure. Per-call environment overrides (read on every call, so one
// process can time several settings; docs/cuda_decode.md):
//   JAX_SDPA_CUDA_DECODE_SPLITS=n     split count (0 / unset: the argument / heuristic)
//   JAX_SDPA_CUDA_DECODE_COMBINE=auto|fused|kernel
//   JAX_SDPA_CUDA_DECODE_CFG=W,S      tensor-core warps x ring stages, where built
//   JAX_SDPA_CUDA_DECODE_MIN_SPLIT_KB=k  least K+V bytes per split (heuristic)
//   JAX_SDPA_CUDA_DECODE_VERBOSE=1    print each new plan to stderr
cudaError_t make_plan(const SdpaParams& p, int device, int force_splits, int combine_mode,
                      DecodePlan* plan);

// Enqueues the kernels on `stream`. `scratch` must hold plan.scratch_bytes
// (16-byte aligned) when plan.num_splits > 1.
cudaError_t launch(const SdpaParams& p, const SdpaFwdBuffers& buf, const DecodePlan& plan,
                   void* scratch, cudaStream_t stream);

}  // namespace cuda_decode
}  // namespace jax_sdpa
