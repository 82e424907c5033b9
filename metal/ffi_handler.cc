// XLA FFI handlers of the Metal backend: jax_sdpa_metal_fwd / _bwd / _paged_fwd, registered
// on JAX's "cpu" platform. Unpacks and checks the call (ffi/ffi_call.h), builds the launch plan
// (metal/host/host_plan.h) and hands it to the platform runner: Metal on macOS
// (metal/host/host_macos.mm), the CPU emulator of the same .metal kernels on Linux
// (metal/host/runner_emulator.cc). The module _sdpa_metal is metal/module.cc.
#include <string>

#include "ffi/ffi_call.h"
#include "ffi/registry.h"
#include "metal/host/host_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {
namespace {

// The contract features these handlers' kernels serve (ffi/sdpa_params.h Feature): the
// registration below declares them, the handlers refuse every other.
constexpr uint32_t kServedFeatures = kFeatureSegmentIds | kFeatureLogitsSoftCap;
// The paged forward reads the pages in place with the same kernels (a paged call has no
// segment ids; soft-capping is served).
constexpr uint32_t kPagedServedFeatures = kServedFeatures;

ffi::Error run_plan(const metal::Plan& plan) {
  metal::Runner* r = metal::runner();
  if (r == nullptr)
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "jax_sdpa metal: no Metal device: " + metal::runner_error());
  std::string err = r->run(plan);
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kInternal, "jax_sdpa metal: " + err);
  return ffi::Error::Success();
}

ffi::Error unsupported(const std::string& why) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "jax_sdpa metal: " + why);
}

ffi::Error MetalFwd(ffi::RemainingArgs args, ffi::RemainingRets rets, SdpaAttrs a) {
  ForwardCall c;
  if (auto e = unpack_forward_call(a, args, rets, 0, kServedFeatures, "metal", &c); e.failure())
    return e;
  metal::Plan plan;
  if (std::string why = metal::plan_forward(c.p, c.buf, &plan); !why.empty())
    return unsupported(why);
  poison_host_outputs({&c.out(), &c.lse()});
  return run_plan(plan);
}

ffi::Error MetalBwd(ffi::RemainingArgs args, ffi::RemainingRets rets, SdpaAttrs a) {
  BackwardCall c;
  if (auto e = unpack_backward_call(a, args, rets, 0, kServedFeatures, "metal", &c);
      e.failure())
    return e;
  metal::Plan plan;
  if (std::string why = metal::plan_backward(c.p, c.buf, &plan); !why.empty())
    return unsupported(why);
  poison_host_outputs({&c.dq(), &c.dk(), &c.dv()});
  return run_plan(plan);
}

ffi::Error MetalPagedFwd(ffi::RemainingArgs args, ffi::RemainingRets rets, SdpaAttrs a) {
  PagedForwardCall c;
  if (auto e = unpack_paged_forward_call(a, args, rets, 0, kPagedServedFeatures, "metal paged",
                                         &c);
      e.failure())
    return e;
  metal::Plan plan;
  if (std::string why = metal::plan_forward(c.p, c.buf, &plan); !why.empty())
    return unsupported(why);
  poison_host_outputs({&c.out(), &c.lse()});
  return run_plan(plan);
}

}  // namespace
}  // namespace jax_sdpa

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_metal_paged_fwd, jax_sdpa::MetalPagedFwd,
                           jax_sdpa::bind_call(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kPagedServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_metal_fwd, jax_sdpa::MetalFwd,
                           jax_sdpa::bind_call(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_metal_bwd, jax_sdpa::MetalBwd,
                           jax_sdpa::bind_call(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kServedFeatures);
