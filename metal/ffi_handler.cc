// XLA FFI handlers of the Metal backend: jax_sdpa_metal_fwd / _bwd / _paged_fwd, registered
// on JAX's "cpu" platform. Unpacks and checks the call (ffi/ffi_args.h), builds the launch plan
// (metal/host/host_plan.h) and hands it to the platform runner: Metal on macOS
// (metal/host/host_macos.mm), the CPU emulator of the same .metal kernels on Linux
// (metal/host/runner_emulator.cc). The module _sdpa_metal is metal/module.cc.
#include <string>

#include "ffi/ffi_args.h"
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

ffi::Error MetalFwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer mask,
                    ffi::AnyBuffer sinks, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                    ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                    SdpaAttrs a) {
  SdpaParams p;
  SdpaFwdBuffers io;
  const OptionalOperands opt{mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                            kv_segment_ids};
  if (auto e = unpack_forward(a, q, k, v, opt, *out, *lse, &p, &io); e.failure())
    return e;
  if (auto e = refuse_unserved(p, kServedFeatures, "metal"); e.failure()) return e;
  metal::Plan plan;
  if (std::string why = metal::plan_forward(p, io, &plan); !why.empty()) return unsupported(why);
  poison_host_outputs({&*out, &*lse});
  return run_plan(plan);
}

ffi::Error MetalBwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                    ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer mask,
                    ffi::AnyBuffer sinks, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                    ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, SdpaAttrs a) {
  SdpaParams p;
  SdpaBwdBuffers io;
  const OptionalOperands opt{mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                            kv_segment_ids};
  if (auto e = unpack_backward(a, q, k, v, out, lse, dout, opt, *dq, *dk, *dv, &p, &io);
      e.failure())
    return e;
  if (auto e = refuse_unserved(p, kServedFeatures, "metal"); e.failure()) return e;
  metal::Plan plan;
  if (std::string why = metal::plan_backward(p, io, &plan); !why.empty()) return unsupported(why);
  poison_host_outputs({&*dq, &*dk, &*dv});
  return run_plan(plan);
}

ffi::Error MetalPagedFwd(ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                         ffi::AnyBuffer page_indices, ffi::AnyBuffer kv_lengths,
                         ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> lse, SdpaAttrs a) {
  SdpaParams p;
  SdpaFwdBuffers io;
  if (auto e = unpack_paged_forward(a, q, k_pages, v_pages, page_indices, kv_lengths, sinks,
                                    *out, *lse, &p, &io);
      e.failure())
    return e;
  if (auto e = refuse_unserved(p, kPagedServedFeatures, "metal paged"); e.failure()) return e;
  metal::Plan plan;
  if (std::string why = metal::plan_forward(p, io, &plan); !why.empty()) return unsupported(why);
  poison_host_outputs({&*out, &*lse});
  return run_plan(plan);
}

}  // namespace
}  // namespace jax_sdpa

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_metal_paged_fwd, jax_sdpa::MetalPagedFwd,
                           jax_sdpa::bind_sdpa_paged_fwd(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kPagedServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_metal_fwd, jax_sdpa::MetalFwd,
                           jax_sdpa::bind_sdpa_fwd(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_metal_bwd, jax_sdpa::MetalBwd,
                           jax_sdpa::bind_sdpa_bwd(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kServedFeatures);
