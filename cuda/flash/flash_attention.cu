// Host side of the flash-attention prefill kernels: checks and the
// dtype dispatch. The kernels are instantiated per dtype in
// flash_attention_{f32,f16,bf16}.cu so that they compile in parallel.
#include <cstdlib>
#include <string>

#include "ffi/tuning_knobs.h"
#include "cuda/flash/flash_attention.h"
#include "cuda/flash/flash_bwd_wide.h"
#include "cuda/flash/flash_launch_checks.h"

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
    return "sequence lengths must be < 2**30";
  return "";
}

bool wgmma_serves(bool backward, const SdpaParams& p, int cc_major, int cc_minor) {
  return (p.dtype == DType::kF16 || p.dtype == DType::kBF16) && wgmma_head_dims(p) &&
         cc_major == 9 && cc_minor == 0 && wgmma_enabled(backward);
}

bool fast_kernels_enabled() {
  static const bool enabled = tuning_knob("JAX_SDPA_FLASH_GENERIC") == nullptr;
  return enabled;
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

namespace {
// The backward scratch: delta = rowsum(dout * out) (f32, one per query row), then, where
// backward_wide_applies(p), the wide backward's fp32 dq accumulator, 16-byte aligned.
size_t delta_bytes(const SdpaParams& p) {
  const size_t rows = static_cast<size_t>(p.batch * p.heads_q * p.len_q);
  return (rows * sizeof(float) + 15) / 16 * 16;
}
}  // namespace

size_t backward_scratch_bytes(const SdpaParams& p) {
  return delta_bytes(p) + backward_wide_accum_bytes(p);
}

cudaError_t launch_backward(const SdpaParams& p, const SdpaBwdBuffers& buf, Fp32Mode mode,
                            void* scratch, cudaStream_t stream) {
  float* delta = static_cast<float*>(scratch);
  float* dq_accum = backward_wide_applies(p) && scratch != nullptr
                        ? reinterpret_cast<float*>(static_cast<char*>(scratch) + delta_bytes(p))
                        : nullptr;
  switch (p.dtype) {
    case DType::kF32: return launch_backward_f32(p, buf, mode, delta, stream);
    case DType::kF16: return launch_backward_f16(p, buf, delta, dq_accum, stream);
    case DType::kBF16: return launch_backward_bf16(p, buf, delta, dq_accum, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
