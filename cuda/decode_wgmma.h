// The wgmma decode kernel (cuda/decode_wgmma.cu: 16-bit D = Dv = 512, 8 query rows a block,
// sm_90a code only), as the decode host (decode_attention_kernels.h, decode_attention.cu)
// sees it: a descriptor per built variant and whether this device runs it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/decode_tma.cuh"  // Args, TmaMaps

namespace jax_sdpa {
namespace cuda_decode {

struct WgmmaDecodeKernel {
  const void* func = nullptr;  // null: this variant is not built
  cudaError_t (*launch)(const Args&, const TmaMaps*, dim3, int, size_t, cudaStream_t) = nullptr;
  int threads = 0;
  size_t smem = 0;
  int keys = 0;  // keys a stage: its tensor maps' box (one box a 64-wide chunk)
};

// Variants: keys a stage x stages in {32 x 3 (the default), 16 x 6}; q_regs: Q as register
// fragments instead of one shared tile read with a zero row stride (built for 32 x 3).
WgmmaDecodeKernel decode_wgmma_kernel(bool bf16, int keys, int stages, bool q_regs);

// Whether the current device has its sm_90a image (H100 / H200); clears the error if not.
bool decode_wgmma_available();

}  // namespace cuda_decode
}  // namespace jax_sdpa
