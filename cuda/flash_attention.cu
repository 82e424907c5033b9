// Host side of the flash-attention prefill kernels (DRAFT): checks and the
// dtype dispatch. The kernels are instantiated per dtype in
// flash_attention_{f32,f16,bf16}.cu so that they compile in parallel.
#include <string>

#include "cuda/flash_attention.h"
#include "cuda/flash_bwd_wide.h"

namespace jax_sdpa {
namespace cuda_flash {

std::string unsupported_reason(const SdpaParams& p) {
  if (p.head_dim % 8 != 0 || p.head_dim_v % 8 != 0)
    return "head dims must be multiples of 8 (got D=" + std::to_string(p.head_dim) +
           ", Dv=" + std::to_string(p.head_dim_v) + ")";
  if (p.head_dim > 512 || p.head_dim_v > 512)
    return "head dims above 512 are not supported (got D=" + std::to_string(p.head_dim) +
           ", Dv=" + std::to_string(p.head_dim_v) + ")";
  if (p.batch > 65535 || p.heads_q > 65535)
    return "batch and query heads must each be <= 65535";
  if (p.len_q >= (int64_t{1} << 30) || p.len_kv >= (int64_t{1} << 30))
    return "sequence lengths must be < 2^30";
  return "";
}

cudaError_t launch_forward(const SdpaParams& p, const SdpaFwdBuffers& buf, Fp32Mode mode,
                           cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kF32: return launch_forward_f32(p, buf, mode, stream);
    case DType::kF16: return launch_forward_f16(p, buf, stream);
    case DType::kBF16: return launch_forward_bf16(p, buf, stream);
  }
  return cudaErrorInvalidValue;
}

size_t backward_scratch_bytes(const SdpaParams& p) {
  const size_t rows = static_cast<size_t>(p.batch * p.heads_q * p.len_q);
  // delta, then (16-bit, 256 < D, Dv <= 512) the wide backward's fp32 dq accumulator, 16-byte
  // aligned right after it (backward_wide_accum in cuda/flash_bwd_wide.cu finds it there).
  return (rows * sizeof(float) + 15) / 16 * 16 + backward_wide_accum_bytes(p);
}

cudaError_t launch_backward(const SdpaParams& p, const SdpaBwdBuffers& buf, Fp32Mode mode,
                            void* scratch, cudaStream_t stream) {
  // scratch = [delta][wide dq accumulator, where backward_wide_applies(p)]: the 16-bit
  // launchers find the accumulator with backward_wide_accum(p, delta).
  float* delta = static_cast<float*>(scratch);
  switch (p.dtype) {
    case DType::kF32: return launch_backward_f32(p, buf, mode, delta, stream);
    case DType::kF16: return launch_backward_f16(p, buf, delta, stream);
    case DType::kBF16: return launch_backward_bf16(p, buf, delta, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
