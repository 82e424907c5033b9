// Fast fp16/bf16 flash-attention backward for head dims above cuDNN's 256 (256 < D, Dv <= 512,
// zero-padded to 512): Gemma-style D = 512. FlashAttention-2 style, mma.sync m16n8k16.
// Kernels: cuda/flash_bwd_wide.cuh; instantiations + launcher: cuda/flash_bwd_wide.cu.
//
// Its fp32 dq accumulator lives in the backward scratch after delta, laid out by
// launch_backward (cuda/flash_attention.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/flash/flash_attention.h"
#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_flash {

// 16-bit dtype with 256 < D, Dv <= 512: the wide backward may serve it (it can still refuse
// at launch, e.g. misaligned buffers), so the scratch holds the fp32 dq accumulator too.
bool backward_wide_applies(const SdpaParams& p);

// Bytes of the fp32 dq accumulator (B * Hq * Lq * D floats), 0 where !backward_wide_applies.
size_t backward_wide_accum_bytes(const SdpaParams& p);

// Enqueues delta, the memset of dq_accum, the dK/dV/dQ kernel and the dq conversion on
// `stream` (writes every element of dq, dk, dv). Returns cudaErrorNotSupported, before
// enqueuing anything, when it can't serve `p` (not 16-bit, head dims outside (256, 512],
// misaligned buffers or strides, not enough opt-in shared memory, no accumulator).
cudaError_t launch_backward_wide(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                                 float* dq_accum, cudaStream_t stream);

}  // namespace cuda_flash
}  // namespace jax_sdpa
