// fp32 instantiations of the flash forward + backward kernels: TF32 and 3xTF32 (see flash_attention.cuh).
#include "cuda/flash/flash_attention_bwd.cuh"
#include "cuda/flash/flash_bwd_tc.h"
#include "cuda/flash/flash_fwd_tc.cuh"


namespace jax_sdpa {
namespace cuda_flash {

cudaError_t launch_forward_f32(const SdpaParams& p, const SdpaFwdBuffers& buf, Fp32Mode mode,
                               cudaStream_t stream) {
  // Head dims <= 128: the tuned tensor-core kernel (flash_fwd_tc.cuh); calls using a
  // contract feature (segment ids, soft-capping) run the generic kernel's kFeat version.
  if (fast_kernels_enabled() && p.features() == 0 && !p.paged()) {
    const cudaError_t e = tc::launch_forward_fast_f32(p, buf, mode, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  const bool wide = p.head_dim_v > 64;
  if (mode == Fp32Mode::kHighest)
    return wide ? launch_fwd_t<float, 2, 128>(p, buf, stream)
                : launch_fwd_t<float, 2, 64>(p, buf, stream);
  return wide ? launch_fwd_t<float, 1, 128>(p, buf, stream)
              : launch_fwd_t<float, 1, 64>(p, buf, stream);
}

cudaError_t launch_backward_f32(const SdpaParams& p, const SdpaBwdBuffers& buf, Fp32Mode mode,
                                float* delta, cudaStream_t stream) {
  // Head dims <= 128: the tuned tensor-core backward (flash_bwd_tc.cuh); features: generic.
  if (fast_kernels_enabled() && p.features() == 0 && !p.paged()) {
    const cudaError_t e = launch_backward_f32_fast(p, buf, mode, delta, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  return mode == Fp32Mode::kHighest ? launch_bwd_t<float, 2>(p, buf, delta, stream)
                                    : launch_bwd_t<float, 1>(p, buf, delta, stream);
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
