// Device helpers shared by our CUDA kernels (decode and flash): cp.async copies and
// conversions between float and the storage types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_sdpa {
namespace cuda_common {

// 16-byte global -> shared copy; pred == false zero-fills and reads nothing.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
}
// The same copy with an L2 prefetch hint: the L2 fetches the whole aligned
// 128- or 256-byte block around the address from DRAM (streaming reads: fewer,
// longer DRAM bursts). kMode = prefetch bytes (0, 128, 256), plus kEvictFirst: the
// lines are marked evict-first in the L2 (a read-once stream; experiment).
constexpr int kEvictFirst = 4;
template <int kMode>
__device__ __forceinline__ void cp_async16_l2(void* smem, const void* gmem, bool pred) {
  constexpr int kPrefetch = kMode & ~kEvictFirst;
  static_assert(kPrefetch == 0 || kPrefetch == 128 || kPrefetch == 256, "L2 prefetch size");
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = pred ? 16 : 0;
  if constexpr ((kMode & kEvictFirst) != 0) {
    static_assert(kPrefetch == 128, "evict-first copies are built with the 128-byte prefetch");
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n" ::
                     "r"(s), "l"(gmem), "r"(n), "l"(policy)
                 : "memory");
  } else if constexpr (kPrefetch == 0) {
    cp_async16(smem, gmem, pred);
  } else if constexpr (kPrefetch == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(n)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(n)
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>  // wait until at most N groups are pending
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats as a packed pair of 16-bit values (lower index in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace cuda_common
}  // namespace jax_sdpa
