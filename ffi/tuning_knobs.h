// Sweep knobs: environment variables that pick kernel variants, plans or modes for tuning
// runs and tests (benchmarks/tuning/, docs/environment.md): the CUDA kernels' and the Metal
// plan's. They and the variants they pick exist only in tuning builds (CMake
// -DJAX_SDPA_TUNING=ON) and in the Metal emulator (a test tool, metal/CMakeLists.txt); a
// product build reads none of them.
#pragma once

#include <cstdlib>

#ifndef JAX_SDPA_TUNING
#define JAX_SDPA_TUNING 0
#endif

namespace jax_sdpa {

constexpr bool kTuningBuild = JAX_SDPA_TUNING != 0;

// The knob's value in a tuning build; nullptr (unset) in a product build.
inline const char* tuning_knob(const char* name) {
#if JAX_SDPA_TUNING
  return std::getenv(name);
#else
  (void)name;
  return nullptr;
#endif
}

}  // namespace jax_sdpa
