// The wgmma flash forward for fp16/bf16 head dims in (256, 512] (cuda/flash_fwd_wgmma.cu,
// sm_90a code only).
#pragma once

#include <cuda_runtime.h>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_flash {

// Runs it when enabled (JAX_SDPA_FLASH_WGMMA not "0": wgmma_enabled, flash_launch_checks.h),
// the dtype is 16-bit and 256 < D, Dv <= 512 on a GPU with sm_90a code (H100 / H200);
// cudaErrorNotSupported otherwise (the caller's kernels serve).
cudaError_t launch_forward_wgmma(const SdpaParams& p, const SdpaFwdBuffers& buf,
                                 cudaStream_t stream);

}  // namespace cuda_flash
}  // namespace jax_sdpa
