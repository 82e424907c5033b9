// f16 instantiations of the flash forward + backward kernels (flash_16bit.cuh).
#include "cuda/flash/flash_16bit.cuh"

namespace jax_sdpa {
namespace cuda_flash {

cudaError_t launch_forward_f16(const SdpaParams& p, const SdpaFwdBuffers& buf,
                               cudaStream_t stream) {
  return launch_forward_16<__half>(p, buf, stream);
}

cudaError_t launch_backward_f16(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                                 float* dq_accum, cudaStream_t stream) {
  return launch_backward_16<__half>(p, buf, delta, dq_accum, stream);
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
