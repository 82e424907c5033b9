// Thread-block clusters (sm_90+): another block's shared memory (distributed shared memory)
// and mbarriers signalled across the blocks of a cluster. Only compiled into kernel bodies
// guarded for sm_90.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/tma_helpers.cuh"

namespace jax_sdpa {
namespace cuda_common {

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of every block of the cluster; orders memory (release / acquire) too.
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// The shared::cluster address of this block's shared object `p` in block `rank`.
__device__ __forceinline__ uint32_t remote_addr(const void* p, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
  return r;
}

__device__ __forceinline__ void st_cluster_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Orders this thread's generic-proxy writes to (any block's) shared memory before
// async-proxy reads of them (another block's wgmma).
__device__ __forceinline__ void fence_proxy_async_cluster() {
  asm volatile("fence.proxy.async.shared::cluster;\n" ::: "memory");
}

// One arrival on the mbarrier at shared::cluster address `bar` (another block's), ordered
// after this thread's earlier loads and stores (release at cluster scope).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar)
               : "memory");
}

// Waits for the phase of this block's mbarrier with this parity, acquiring at cluster scope
// what the (remote) arrivals released.
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

}  // namespace cuda_common
}  // namespace jax_sdpa
