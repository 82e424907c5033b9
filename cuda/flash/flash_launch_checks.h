// Host-side checks (and the on / off knob) shared by the fast flash launchers: each refuses
// (cudaErrorNotSupported, nothing enqueued) and the generic kernels run unless the call's
// grid, strides, buffers and the device's shared memory suit it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <initializer_list>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_flash {

// A grid of (key tiles, kv heads, batch), query heads a whole multiple of kv heads, and
// lengths that index in 32 bits.
inline bool backward_grid_fits(const SdpaParams& p) {
  return p.heads_kv > 0 && p.heads_q % p.heads_kv == 0 && p.batch <= 65535 &&
         p.heads_kv <= 65535 && p.len_q < (int64_t{1} << 30) && p.len_kv < (int64_t{1} << 30);
}

// Every stride of q, k, v and out a multiple of `elems` elements (vector and 16-byte
// copies along rows).
inline bool strides_multiple_of(const SdpaParams& p, int64_t elems) {
  for (int i = 0; i < 3; ++i)
    if (p.q_stride[i] % elems || p.k_stride[i] % elems || p.v_stride[i] % elems ||
        p.o_stride[i] % elems)
      return false;
  return true;
}

inline bool all_aligned16(std::initializer_list<const void*> buffers) {
  for (const void* b : buffers)
    if (reinterpret_cast<uintptr_t>(b) & 15u) return false;
  return true;
}

// The wgmma kernels (flash_fwd_wgmma.cu, flash_bwd_wgmma.cu): their on / off knobs and the
// head dims they take (both in (256, 512]; sm_90a code, so compute capability 9.0 only).
constexpr const char* kWgmmaForwardKnob = "JAX_SDPA_FLASH_WGMMA";
constexpr const char* kWgmmaBackwardKnob = "JAX_SDPA_FLASH_WGMMA_BWD";

// Whether the wgmma kernel of this direction may run: yes unless its knob is "0". The one
// reader of the knobs: dispatch (wgmma_serves) and the launchers ask it at each call, so both
// always see the same setting.
inline bool wgmma_enabled(bool backward) {
  const char* v = std::getenv(backward ? kWgmmaBackwardKnob : kWgmmaForwardKnob);
  return v == nullptr || v[0] != '0';
}
constexpr int64_t kWgmmaMaxHeadDim = 512;
inline bool wgmma_head_dims(const SdpaParams& p) {
  return p.head_dim > 256 && p.head_dim_v > 256 && p.head_dim <= kWgmmaMaxHeadDim &&
         p.head_dim_v <= kWgmmaMaxHeadDim;
}

// The current device's opt-in shared memory per block; 0 when it can't be read (the error
// is cleared: nothing may be left behind for the fallback).
inline int max_smem_optin() {
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return optin;
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
