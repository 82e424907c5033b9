// `registrations()` of a nanobind module: {FFI target name: capsule} for every handler its
// sources registered (ffi/registry.h), for jax.ffi.register_ffi_target (jax_sdpa/_ext.py).
#pragma once

#include <nanobind/nanobind.h>

#include "ffi/registry.h"
#include "ffi/sdpa_params.h"

namespace jax_sdpa {

inline void def_registrations(nanobind::module_& m) {
  m.def(
      "registrations",
      []() {
        nanobind::dict d;
        for (const FfiTarget& t : ffi_targets()) d[t.name.c_str()] = nanobind::capsule(t.handler);
        return d;
      },
      "{FFI target name: capsule} for jax.ffi.register_ffi_target.");
  m.def(
      "served_features",
      []() {
        nanobind::dict d;
        for (const FfiTarget& t : ffi_targets()) {
          nanobind::list names;
          for (uint32_t f = 1; f <= kAllFeatures; f <<= 1)
            if (t.features & f) names.append(feature_name(f));
          d[t.name.c_str()] = names;
        }
        return d;
      },
      "{FFI target name: [contract features its kernels serve]} (ffi/sdpa_params.h Feature).");
}

}  // namespace jax_sdpa
