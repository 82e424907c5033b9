// nanobind module _sdpa_metal: the Metal FFI handlers (metal/ffi_handler.cc) for
// jax_sdpa/_ext.py, what the platform runner says about itself, and the shapes the kernels
// refuse (jax_sdpa/dispatch.py asks it, never re-derives it).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "ffi/module_facts.h"
#include "ffi/module_registrations.h"
#include "metal/host/host_plan.h"

namespace nb = nanobind;

NB_MODULE(_sdpa_metal, m) {
  m.doc() = "jax_sdpa Metal backend (Metal on macOS, the CPU emulator of its kernels on Linux)";
  jax_sdpa::def_registrations(m);
  m.def(
      "describe",
      []() -> std::string {
        jax_sdpa::metal::Runner* r = jax_sdpa::metal::runner();
        return r ? r->describe() : "unavailable: " + jax_sdpa::metal::runner_error();
      },
      "'emulator (...)' on Linux, the Metal device name on macOS.");
  m.def(
      "available", []() { return jax_sdpa::metal::runner() != nullptr; },
      "Whether a runner (Metal device or emulator) is usable.");
  m.def(
      "is_emulator",
      []() {
#ifdef JAX_SDPA_METAL_EMULATED
        return true;
#else
        return false;
#endif
      },
      "True when the kernels run on the CPU emulator.");
  jax_sdpa::def_shape_fact(m, "unsupported_reason", &jax_sdpa::metal::unsupported_reason,
                           "Why the Metal kernels can't serve these shapes ('' when they can).");
}
