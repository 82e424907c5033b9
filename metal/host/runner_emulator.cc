// Runner for the Linux emulator: executes a Plan by calling the emulated kernels
// (host_emulator.cc, built by clang) through their C entry point.
#include <cmath>
#include <limits>
#include <memory>

#include "metal/host/host_plan.h"

extern "C" int jax_sdpa_metal_emu_launch(const char* kernel, const uint32_t grid[3],
                                         uint32_t threads, void* const* buffers, int nbuffers,
                                         char* err, size_t errlen);
extern "C" int jax_sdpa_metal_emu_workers();
extern "C" int jax_sdpa_metal_emu_kernel_count();

namespace jax_sdpa {
namespace metal {
namespace {

class EmulatorRunner : public Runner {
 public:
  std::string describe() override {
    return "emulator (Metal kernels compiled as C++ by clang, " +
           std::to_string(jax_sdpa_metal_emu_kernel_count()) + " kernels, " +
           std::to_string(jax_sdpa_metal_emu_workers()) + " CPU threads)";
  }

  std::string run(const Plan& plan) override {
    SdpaMetalParams params = plan.params;
    std::vector<std::unique_ptr<float[]>> scratch;
    std::vector<void*> ptrs(plan.buffers.size(), nullptr);
    for (size_t i = 0; i < plan.buffers.size(); ++i) {
      const PlanBuffer& b = plan.buffers[i];
      switch (b.kind) {
        case BufKind::kInput:
        case BufKind::kOutput: ptrs[i] = b.ptr; break;
        case BufKind::kParams: ptrs[i] = &params; break;
        case BufKind::kScratch: {
          if (b.bytes == 0) break;
          // NaN-poisoned: a kernel reading scratch it never wrote shows up in the results.
          const size_t n = (b.bytes + sizeof(float) - 1) / sizeof(float);
          scratch.emplace_back(new float[n]);
          std::fill(scratch.back().get(), scratch.back().get() + n,
                    std::numeric_limits<float>::quiet_NaN());
          ptrs[i] = scratch.back().get();
          break;
        }
      }
    }
    for (const PlanLaunch& l : plan.launches) {
      std::vector<void*> args;
      for (int a : l.args) args.push_back(ptrs[size_t(a)]);
      char err[1024];
      if (jax_sdpa_metal_emu_launch(l.kernel.c_str(), l.grid, l.threads, args.data(),
                                    int(args.size()), err, sizeof(err)) != 0)
        return std::string("Metal emulator: ") + err;
    }
    return "";
  }
};

}  // namespace

Runner* runner() {
  static EmulatorRunner r;
  return &r;
}
std::string runner_error() { return ""; }

}  // namespace metal
}  // namespace jax_sdpa
