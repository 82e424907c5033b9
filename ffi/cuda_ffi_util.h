// Helpers shared by the CUDA-platform handlers (cuDNN, our decode and flash kernels).
#pragma once

#include <cuda_runtime_api.h>

#include <initializer_list>
#include <string>

#include "ffi/ffi_args.h"

namespace jax_sdpa {

// A CUDA runtime failure as a readable ffi::Error ("jax_sdpa <who>: <what>: <name> (<text>)").
inline ffi::Error cuda_error(const char* who, const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_sdpa ") + who + ": " + what + ": " +
                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// `bytes` of device scratch from XLA's allocator into *out (nullptr when bytes == 0), 16-byte
// aligned: XLA's FFI allocator refuses larger alignments (its blocks are 256-aligned anyway).
inline ffi::Error allocate_scratch(ffi::ScratchAllocator& scratch, size_t bytes, const char* who,
                                   const char* what, void** out) {
  *out = nullptr;
  if (bytes == 0) return ffi::Error::Success();
  auto mem = scratch.Allocate(bytes, 16);
  if (!mem.has_value())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string("jax_sdpa ") + who + ": could not allocate " +
                          std::to_string(bytes) + " bytes of " + what);
  *out = *mem;
  return ffi::Error::Success();
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

// What a CUDA handler does between unpacking a call and running its kernels: refuse what its
// backend can't serve (`why` not empty: kUnimplemented, "jax_sdpa <who>: <why>"), then poison
// the outputs when the tests ask.
inline ffi::Error refuse_or_poison(const char* who, const std::string& why, cudaStream_t stream,
                                   std::initializer_list<const ffi::AnyBuffer*> outputs) {
  if (!why.empty())
    return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string("jax_sdpa ") + who + ": " + why);
  return poison_outputs(who, stream, outputs);
}

}  // namespace jax_sdpa
