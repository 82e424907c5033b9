// Fast float32 flash-attention backward (TF32 / 3xTF32 tensor cores, FlashAttention-2
// style), head dims D <= 128 and Dv <= 128 (multiples of 8). Host API, plain C++.
// Kernel: cuda/flash_bwd_tc.cuh; instantiations + launcher: cuda/flash_bwd_tc_f32.cu.
// Checked and timed through the module by benchmarks/gpu_flash_check.py.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/flash/flash_attention.h"
#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_flash {

// Enqueues the fast backward on `stream`: dq (zeroed here, then float atomics), dk, dv
// (every element written). `delta` is scratch of 4 * B * Hq * Lq bytes (rowsum(dout * out)).
// Returns cudaErrorNotSupported, before enqueuing anything, when it cannot serve `p`
// (not float32, D or Dv > 128 or not a multiple of 8, misaligned buffers or strides,
// not enough opt-in shared memory on this device, grid limits): the caller then falls
// back to the generic backward.
cudaError_t launch_backward_f32_fast(const SdpaParams& p, const SdpaBwdBuffers& buf,
                                     Fp32Mode mode, float* delta, cudaStream_t stream);

}  // namespace cuda_flash
}  // namespace jax_sdpa
