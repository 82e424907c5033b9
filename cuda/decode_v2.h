// Decode v2 (DRAFT, compile-checked only): persistent, producer/consumer decode
// kernel with Hopper bulk copies. Opt-in per call with JAX_SDPA_CUDA_DECODE_V2=1;
// the current kernels (cuda/decode_attention.*) stay the default. Design and
// status: docs/cuda_decode.md, section "v2 draft (not yet run)".
//
// Plain C++ (the FFI handler's host compiler includes decode_attention.h, which
// does not include this file; only decode_attention.cu and decode_v2.cu do).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_decode {
namespace v2 {

// JAX_SDPA_CUDA_DECODE_V2=1 (read on every call).
bool enabled();

// Scratch bytes v2 needs for `p` on `device` (split-K partials), or 0 when v2
// does not serve `p` (dtype, head dims, rows per kv head, alignment, pre-sm_90
// device, ...): the caller then runs the current kernels.
size_t scratch_bytes(const SdpaParams& p, int device);

// Enqueues v2 for `p` if it serves it: *served = true and the launch status.
// *served = false (and cudaSuccess) when it does not (the caller falls back),
// including when `scratch_size` < scratch_bytes(p, device). `counters`: the
// device's zeroed, self-resetting int counters (at least `num_counters`), for
// the fused combine; null -> separate combine kernel.
cudaError_t launch(const SdpaParams& p, const SdpaFwdBuffers& buf, void* scratch,
                   size_t scratch_size, int* counters, int num_counters, cudaStream_t stream,
                   bool* served);

}  // namespace v2
}  // namespace cuda_decode
}  // namespace jax_sdpa
