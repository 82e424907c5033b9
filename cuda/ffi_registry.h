// The list of FFI handlers that the _sdpa_cuda module exposes through
// `registrations()`. A handler source registers itself with
// JAX_SDPA_REGISTER_CUDA_TARGET(name, symbol) at namespace scope, so adding a
// handler means adding its source to JAX_SDPA_CUDA_SOURCES (cuda/CMakeLists.txt)
// and nothing else.
#pragma once

#include <string>
#include <vector>

namespace jax_sdpa {

struct CudaFfiTarget {
  std::string name;  // the XLA custom-call target, e.g. "jax_sdpa_cudnn_fwd"
  void* handler;     // the XLA_FFI_Handler* defined by XLA_FFI_DEFINE_HANDLER_SYMBOL
};

// Function-local static: safe to use from other translation units' static
// initializers, whatever their order.
inline std::vector<CudaFfiTarget>& cuda_ffi_targets() {
  static std::vector<CudaFfiTarget> targets;
  return targets;
}

struct CudaFfiTargetRegistrar {
  CudaFfiTargetRegistrar(const char* name, void* handler) {
    cuda_ffi_targets().push_back({name, handler});
  }
};

}  // namespace jax_sdpa

#define JAX_SDPA_CONCAT_INNER(a, b) a##b
#define JAX_SDPA_CONCAT(a, b) JAX_SDPA_CONCAT_INNER(a, b)
#define JAX_SDPA_REGISTER_CUDA_TARGET(name, symbol)                                 \
  static ::jax_sdpa::CudaFfiTargetRegistrar JAX_SDPA_CONCAT(jax_sdpa_registrar_,   \
                                                            __COUNTER__)(          \
      name, reinterpret_cast<void*>(symbol))
