// The main kernel of the wide-head fp16/bf16 flash backward (head dims in (256, 512]) on
// Hopper's warpgroup MMA (cuda/flash_bwd_wgmma.cu, sm_90a code only). It replaces
// flash_bwd_wide_kernel's launch inside launch_backward_wide (cuda/flash_bwd_wide.cu) on
// H100 / H200 unless JAX_SDPA_FLASH_WGMMA_BWD=0; delta, the dq_accum memset and the dq
// conversion stay the wide backward's.
#pragma once

#include <cuda_runtime_api.h>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_flash {

namespace bwd_wide {
struct Args;  // cuda/flash_bwd_wide.cuh
}  // namespace bwd_wide

// Enqueues the dK / dV / dq_accum kernel for `a` (same inputs and outputs as
// flash_bwd_wide_kernel: dq_accum zeroed and delta computed before it, dq converted after).
// Returns cudaErrorNotSupported, enqueuing nothing, unless it is enabled
// (JAX_SDPA_FLASH_WGMMA_BWD not "0": flash_launch_checks.h, wgmma_enabled), the dtype is
// 16-bit, 256 < D, Dv <= 512 and the GPU has its sm_90a code (H100 / H200).
cudaError_t launch_backward_wgmma_main(const bwd_wide::Args& a, const SdpaParams& p,
                                       cudaStream_t stream);

}  // namespace cuda_flash
}  // namespace jax_sdpa
