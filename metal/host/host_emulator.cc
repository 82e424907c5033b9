// The Linux emulator's kernel side: the project's .metal files compiled as C++ by clang through
// msl_emulator.h, exposed to the rest of the module through a plain C function (this object
// is built by clang; the handler may be built by another compiler).
#include "metal/host/msl_emulator.h"

#include "metal/kernels/sdpa_backward.metal"
#include "metal/kernels/sdpa_decode.metal"
#include "metal/kernels/sdpa_forward.metal"

// float -> bfloat conversions compile to a call of this compiler-rt helper, which older libgccs
// (Debian 12's) lack; defining it here (round to nearest even, NaN stays NaN) spares the
// module a dependency on libclang-rt. Hidden, so it never interposes on anyone else's.
extern "C" __attribute__((visibility("hidden"))) __bf16 __truncsfbf2(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  uint16_t h;
  if ((u & 0x7fffffffu) > 0x7f800000u)
    h = uint16_t((u >> 16) | 0x40u);  // quiet NaN
  else
    h = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  __bf16 r;
  std::memcpy(&r, &h, sizeof(r));
  return r;
}

extern "C" int jax_sdpa_metal_emu_launch(const char* kernel, const uint32_t grid[3],
                                         uint32_t threads, void* const* buffers, int nbuffers,
                                         char* err, size_t errlen) {
  mslemu::Dim3 g;
  g.x = grid[0];
  g.y = grid[1];
  g.z = grid[2];
  std::string e = mslemu::launch(kernel, g, int(threads), buffers, nbuffers);
  if (e.empty()) return 0;
  std::snprintf(err, errlen, "%s: %s", kernel, e.c_str());
  return 1;
}

extern "C" int jax_sdpa_metal_emu_workers() {
  return mslemu::worker_count();
}

extern "C" int jax_sdpa_metal_emu_kernel_count() { return int(mslemu::registry().size()); }
