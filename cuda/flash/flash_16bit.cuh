// The fp16 / bf16 launchers of the flash forward + backward, one template for both dtypes
// (flash_f16.cu and flash_bf16.cu instantiate it, one translation unit each).
#pragma once

#include "cuda/flash/flash_attention_bwd.cuh"
#include "cuda/flash/flash_bwd_wide.h"
#include "cuda/flash/flash_fwd_wgmma.h"
#include "cuda/flash/flash_fwd_wide.cuh"

namespace jax_sdpa {
namespace cuda_flash {

template <typename T>
cudaError_t launch_forward_16(const SdpaParams& p, const SdpaFwdBuffers& buf, cudaStream_t stream) {
  // Head dims in (256, 512]: on sm_90a the wgmma kernel (flash_fwd_wgmma.cu), elsewhere
  // (or with JAX_SDPA_FLASH_WGMMA=0) the wide-head kernel (flash_fwd_wide.cuh). Calls using
  // a contract feature (segment ids, soft-capping) run the generic kernel's kFeat version.
  if (fast_kernels_enabled() && p.features() == 0 && !p.paged()) {
    cudaError_t e = launch_forward_wgmma(p, buf, stream);
    if (e != cudaErrorNotSupported) return e;
    e = wide::launch_forward_wide<T>(p, buf, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  return p.head_dim_v > 64 ? launch_fwd_t<T, 0, 128>(p, buf, stream)
                           : launch_fwd_t<T, 0, 64>(p, buf, stream);
}

template <typename T>
cudaError_t launch_backward_16(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                                 float* dq_accum, cudaStream_t stream) {
  // Head dims in (256, 512]: the wide-head backward (flash_bwd_wide.cuh); features: generic.
  if (fast_kernels_enabled() && p.features() == 0 && !p.paged()) {
    const cudaError_t e = launch_backward_wide(p, buf, delta, dq_accum, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  return launch_bwd_t<T, 0>(p, buf, delta, stream);
}

}  // namespace cuda_flash
}  // namespace jax_sdpa

// launch_forward_<suffix> / launch_backward_<suffix> for storage type T (flash_attention.h).
#define JAX_SDPA_FLASH_16BIT_LAUNCHERS(suffix, T)                                             \
  namespace jax_sdpa::cuda_flash {                                                           \
  cudaError_t launch_forward_##suffix(const SdpaParams& p, const SdpaFwdBuffers& buf,         \
                                      cudaStream_t stream) {                                 \
    return launch_forward_16<T>(p, buf, stream);                                             \
  }                                                                                          \
  cudaError_t launch_backward_##suffix(const SdpaParams& p, const SdpaBwdBuffers& buf,        \
                                       float* delta, float* dq_accum, cudaStream_t stream) { \
    return launch_backward_16<T>(p, buf, delta, dq_accum, stream);                           \
  }                                                                                          \
  }
