// Internal to cuda/decode_attention*.cu: kernel descriptors and per-dtype
// selectors, so that the three dtypes' instantiations compile in parallel
// (decode_attention.cu: fp32 + host logic, decode_attention_f16.cu, _bf16.cu).
#pragma once

#include <cstdint>

#include "decode_attention.cuh"

namespace jax_sdpa {
namespace cuda_decode {

// (D, Dv) pairs we instantiate (a test build may define a shorter list).
#ifndef JAX_SDPA_DECODE_DIMS
#define JAX_SDPA_DECODE_DIMS(X) \
  X(64, 64)                     \
  X(72, 72)                     \
  X(80, 80)                     \
  X(96, 96)                     \
  X(128, 128)                   \
  X(192, 192)                   \
  X(256, 256)                   \
  X(512, 512)                   \
  X(192, 128)                   \
  X(96, 64)
#endif

struct KernelInfo {
  const void* func = nullptr;
  void (*launch)(const Args&, dim3, int, size_t, cudaStream_t) = nullptr;
  void (*combine)(const Args&, dim3, cudaStream_t) = nullptr;
  int threads = 0;
  size_t smem = 0;
  bool tensor_cores = false;
};

// Null func when (d, dv) is not built. rows16: 16 query rows per block.
KernelInfo select_f32(int64_t d, int64_t dv);
KernelInfo select_f16(int64_t d, int64_t dv, bool rows16);
KernelInfo select_bf16(int64_t d, int64_t dv, bool rows16);

template <typename T, int DV>
void launch_combine(const Args& a, dim3 grid, cudaStream_t st) {
  combine_kernel<T, DV><<<grid, 128, 0, st>>>(a);
}

// Warps per block and ring depth: enough bytes in flight per SM (a few tens of
// KB) from several blocks, each stage one 16-key tile of K and V per warp.
template <typename T, int D, int DV, int NT>
KernelInfo tc_info() {
  constexpr int W = 4;
  constexpr int S = (D + DV <= 256) ? 2 : 1;
  using Cfg = TcConfig<T, D, DV, NT, W, S>;
  KernelInfo k;
  k.func = reinterpret_cast<const void*>(&decode_tc_kernel<T, D, DV, NT, W, S>);
  k.launch = [](const Args& a, dim3 grid, int threads, size_t smem, cudaStream_t st) {
    decode_tc_kernel<T, D, DV, NT, W, S><<<grid, threads, smem, st>>>(a);
  };
  k.combine = &launch_combine<T, DV>;
  k.threads = Cfg::kThreads;
  k.smem = Cfg::kSmem;
  k.tensor_cores = true;
  return k;
}

template <int D, int DV>
KernelInfo simt_info() {
  constexpr int W = (D + DV <= 512) ? 4 : 2;
  constexpr int S = 1;
  using Cfg = SimtConfig<D, DV, W, S>;
  KernelInfo k;
  k.func = reinterpret_cast<const void*>(&decode_simt_kernel<D, DV, W, S>);
  k.launch = [](const Args& a, dim3 grid, int threads, size_t smem, cudaStream_t st) {
    decode_simt_kernel<D, DV, W, S><<<grid, threads, smem, st>>>(a);
  };
  k.combine = &launch_combine<float, DV>;
  k.threads = Cfg::kThreads;
  k.smem = Cfg::kSmem;
  k.tensor_cores = false;
  return k;
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
