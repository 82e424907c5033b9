// The FFI targets a native module exposes. Every handler source defines and registers its
// handlers at global scope with JAX_SDPA_DEFINE_FFI_TARGET(symbol, impl, binding, features):
// the XLA handler `symbol` (XLA_FFI_DEFINE_HANDLER_SYMBOL) registered as the custom-call
// target of the same name, `features` being the Feature bits (ffi/sdpa_params.h) its kernels
// serve -- the same constant its handler passes to refuse_unserved. The module's `registrations()` and
// `served_features()` (ffi/module_registrations.h) hand them to jax_sdpa/_ext.py. So
// adding a handler means adding its source to its module's sources, nothing else.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jax_sdpa {

struct FfiTarget {
  std::string name;  // the XLA custom-call target, e.g. "jax_sdpa_cudnn_fwd"
  void* handler;     // the XLA_FFI_Handler* defined by XLA_FFI_DEFINE_HANDLER_SYMBOL
  uint32_t features;  // Feature bits its kernels serve
};

// Function-local static: safe to use from other translation units' static
// initializers, whatever their order. One list per module (each is its own shared object).
inline std::vector<FfiTarget>& ffi_targets() {
  static std::vector<FfiTarget> targets;
  return targets;
}

struct FfiTargetRegistrar {
  FfiTargetRegistrar(const char* name, void* handler, uint32_t features) {
    ffi_targets().push_back({name, handler, features});
  }
};

}  // namespace jax_sdpa

#define JAX_SDPA_CONCAT_INNER(a, b) a##b
#define JAX_SDPA_CONCAT(a, b) JAX_SDPA_CONCAT_INNER(a, b)
#define JAX_SDPA_REGISTER_FFI_TARGET(name, symbol, features)                      \
  static ::jax_sdpa::FfiTargetRegistrar JAX_SDPA_CONCAT(jax_sdpa_registrar_,      \
                                                        __COUNTER__)(             \
      name, reinterpret_cast<void*>(symbol), features)

// After `features`, the handler's XLA FFI traits if any (e.g. kCmdBufferCompatible). The
// handler source includes xla/ffi/api/ffi.h, which defines XLA_FFI_DEFINE_HANDLER_SYMBOL.
#define JAX_SDPA_DEFINE_FFI_TARGET(symbol, impl, binding, features, ...) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl, binding, ##__VA_ARGS__);   \
  JAX_SDPA_REGISTER_FFI_TARGET(#symbol, symbol, features)
