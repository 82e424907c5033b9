// Fast fp16/bf16 flash-attention backward for head dims above cuDNN's 256 (256 < D, Dv <= 512,
// zero-padded to 512): Gemma-style D = 512. FlashAttention-2 style, mma.sync m16n8k16.
// Kernels: cuda/flash_bwd_wide.cuh; instantiations + launcher: cuda/flash_bwd_wide.cu.
// UNTESTED ON A GPU when written (compile-checked only).
//
// Scratch layout (ffi handler allocates backward_scratch_bytes(p), 16-byte aligned):
//   [delta: 4 * B * Hq * Lq bytes, rounded up to 16][dq accumulator: 4 * B * Hq * Lq * D bytes]
// The accumulator is reserved only where backward_wide_applies(p).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/flash_attention.h"
#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_flash {

// 16-bit dtype with 256 < D, Dv <= 512: the wide backward may serve it (it can still refuse
// at launch, e.g. misaligned buffers), so the scratch holds the fp32 dq accumulator too.
bool backward_wide_applies(const SdpaParams& p);

// Bytes of the fp32 dq accumulator (B * Hq * Lq * D floats), 0 where !backward_wide_applies.
size_t backward_wide_accum_bytes(const SdpaParams& p);

// Where the accumulator starts in the backward scratch (right after delta, 16-byte aligned);
// nullptr where !backward_wide_applies(p).
float* backward_wide_accum(const SdpaParams& p, float* delta);

// Enqueues delta, the memset of dq_accum, the dK/dV/dQ kernel and the dq conversion on
// `stream` (writes every element of dq, dk, dv). Returns cudaErrorNotSupported, before
// enqueuing anything, when it can't serve `p` (not 16-bit, head dims outside (256, 512],
// misaligned buffers or strides, not enough opt-in shared memory, no accumulator).
cudaError_t launch_backward_wide(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                                 float* dq_accum, cudaStream_t stream);

}  // namespace cuda_flash
}  // namespace jax_sdpa
