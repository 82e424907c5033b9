// Helpers shared by the CUDA-platform handlers (cuDNN, our decode and flash kernels).
#pragma once

#include <cuda_runtime_api.h>

#include <initializer_list>
#include <string>

#include "ffi/ffi_decode.h"

namespace jax_sdpa {

// A CUDA runtime failure as a readable ffi::Error ("jax_sdpa <who>: <what>: <name> (<text>)").
inline ffi::Error cuda_error(const char* who, const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_sdpa ") + who + ": " + what + ": " +
                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// JAX_SDPA_POISON_OUTPUTS (tests): NaN-fill the outputs on the stream before the kernel
// runs, so that an element nobody writes fails the comparison (0xFF bytes are NaN in
// f32, f16 and bf16).
inline ffi::Error poison_outputs(const char* who, cudaStream_t stream,
                                 std::initializer_list<const ffi::AnyBuffer*> outputs) {
  if (!poison_outputs_requested()) return ffi::Error::Success();
  for (const ffi::AnyBuffer* out : outputs) {
    if (out->size_bytes() == 0) continue;
    cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0xFF, out->size_bytes(), stream);
    if (e != cudaSuccess) return cuda_error(who, "poisoning outputs", e);
  }
  return ffi::Error::Success();
}

}  // namespace jax_sdpa
