// Our CUDA flash-attention prefill kernels (forward + backward), host API
// (docs/cuda_flash.md). Serves what cuDNN refuses: float32 inputs (TF32 tensor cores, or split-TF32 "3xTF32" for full fp32
// accuracy) and fp16/bf16 at head dims up to 512 (any multiple of 8).
// Semantics: docs/ffi_contract.md. Plain C++ so the host-compiled FFI handler
// can include it.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_flash {

// fp32 precision: kTf32 (JAX's default matmul precision) or kHighest (split-TF32,
// ~fp32 accuracy), from the contract's fp32_precision attribute (cuda/flash/ffi_handler.cc).
enum class Fp32Mode : int { kTf32 = 0, kHighest = 1 };

// Empty when the flash kernels can serve `p`, else why not.
std::string unsupported_reason(const SdpaParams& p);

// Whether the wgmma kernel of this direction (fwd: flash_fwd_wgmma.cu, bwd: the main kernel of
// the wide backward, flash_bwd_wgmma.cu) runs `p` on a GPU of compute capability
// cc_major.cc_minor: fp16 / bf16, 256 < D, Dv <= 512, sm_90a code (9.0 only) and its knob
// (JAX_SDPA_FLASH_WGMMA / _BWD, read at each call by wgmma_enabled, as the launchers do) not
// "0".
bool wgmma_serves(bool backward, const SdpaParams& p, int cc_major, int cc_minor);

// Whether the tuned kernels (flash_fwd_tc, flash_bwd_tc, flash_fwd_wide, flash_bwd_wide) are
// tried before the generic ones: yes unless JAX_SDPA_FLASH_GENERIC is set (read once).
bool fast_kernels_enabled();

// Enqueues the forward kernel on `stream` (writes every element of out + lse).
cudaError_t launch_forward(const SdpaParams& p, const SdpaFwdBuffers& buf, Fp32Mode mode,
                           cudaStream_t stream);

// Per-dtype launchers (one translation unit each, compiled in parallel).
cudaError_t launch_forward_f32(const SdpaParams& p, const SdpaFwdBuffers& buf, Fp32Mode mode,
                               cudaStream_t stream);
cudaError_t launch_forward_f16(const SdpaParams& p, const SdpaFwdBuffers& buf,
                               cudaStream_t stream);
cudaError_t launch_forward_bf16(const SdpaParams& p, const SdpaFwdBuffers& buf,
                                cudaStream_t stream);

// Backward: bytes of device scratch launch_backward needs (delta = rowsum(dout * out), f32).
size_t backward_scratch_bytes(const SdpaParams& p);

// Enqueues the backward kernels (writes every element of dq, dk, dv). `scratch` holds
// backward_scratch_bytes(p), 16-byte aligned.
cudaError_t launch_backward(const SdpaParams& p, const SdpaBwdBuffers& buf, Fp32Mode mode,
                            void* scratch, cudaStream_t stream);
cudaError_t launch_backward_f32(const SdpaParams& p, const SdpaBwdBuffers& buf, Fp32Mode mode,
                                float* delta, cudaStream_t stream);
// 16-bit: `dq_accum` is the wide backward's fp32 dq accumulator in the scratch (nullptr
// where backward_wide_applies(p) is false).
cudaError_t launch_backward_f16(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                                float* dq_accum, cudaStream_t stream);
cudaError_t launch_backward_bf16(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                                 float* dq_accum, cudaStream_t stream);

}  // namespace cuda_flash
}  // namespace jax_sdpa
