// XLA FFI handlers of the native CPU kernel: jax_sdpa_cpu_fwd / jax_sdpa_cpu_bwd and the
// paged forward jax_sdpa_cpu_paged_fwd (pages read in place).
// Operands and attributes as in docs/ffi_contract.md; everything is checked by
// unpack_*_call (ffi/ffi_call.h) before the kernel touches memory.
#include <cstring>
#include <string>

#include "cpu/attention_cpu.h"
#include "ffi/ffi_call.h"
#include "ffi/registry.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {
namespace {

// The contract features these handlers' kernels serve (ffi/sdpa_params.h Feature): the
// registration below declares them, the handlers refuse every other.
constexpr uint32_t kServedFeatures = kFeatureSegmentIds | kFeatureLogitsSoftCap;
// The paged forward (pages read in place; a paged call has no segment ids).
constexpr uint32_t kPagedServedFeatures = kFeatureLogitsSoftCap;

namespace ffi = xla::ffi;

ffi::Error CpuFwd(ffi::RemainingArgs args, ffi::RemainingRets rets, SdpaAttrs a) {
  ForwardCall c;
  if (auto e = unpack_forward_call(a, args, rets, 0, kServedFeatures, "cpu", &c); e.failure())
    return e;
  poison_host_outputs({&c.out(), &c.lse()});
  if (const char* err = cpu::sdpa_forward(c.p, c.buf)) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

ffi::Error CpuBwd(ffi::RemainingArgs args, ffi::RemainingRets rets, SdpaAttrs a) {
  BackwardCall c;
  if (auto e = unpack_backward_call(a, args, rets, 0, kServedFeatures, "cpu", &c); e.failure())
    return e;
  poison_host_outputs({&c.dq(), &c.dk(), &c.dv()});
  if (const char* err = cpu::sdpa_backward(c.p, c.buf)) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

ffi::Error CpuPagedFwd(ffi::RemainingArgs args, ffi::RemainingRets rets, SdpaAttrs a) {
  PagedForwardCall c;
  if (auto e = unpack_paged_forward_call(a, args, rets, 0, kPagedServedFeatures, "cpu paged", &c);
      e.failure())
    return e;
  poison_host_outputs({&c.out(), &c.lse()});
  if (const char* err = cpu::sdpa_forward(c.p, c.buf)) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sdpa

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cpu_fwd, jax_sdpa::CpuFwd,
                           jax_sdpa::bind_call(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cpu_bwd, jax_sdpa::CpuBwd,
                           jax_sdpa::bind_call(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cpu_paged_fwd, jax_sdpa::CpuPagedFwd,
                           jax_sdpa::bind_call(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kPagedServedFeatures);

