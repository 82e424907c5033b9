// XLA FFI handlers of the native CPU kernel: jax_sdpa_cpu_fwd / jax_sdpa_cpu_bwd and the
// paged forward jax_sdpa_cpu_paged_fwd (pages read in place).
// Operands and attributes as in docs/ffi_contract.md; everything is checked by
// unpack_forward / unpack_backward before the kernel touches memory.
#include <cstring>
#include <string>

#include "cpu/attention_cpu.h"
#include "ffi/ffi_args.h"
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

ffi::Error CpuFwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer mask,
                  ffi::AnyBuffer sinks, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                  ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, SdpaAttrs a) {
  SdpaParams p;
  SdpaFwdBuffers buf;
  const OptionalOperands opt{mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                            kv_segment_ids};
  if (auto e = unpack_forward(a, q, k, v, opt, *out, *lse, &p, &buf); e.failure())
    return e;
  if (auto e = refuse_unserved(p, kServedFeatures, "cpu"); e.failure()) return e;
  poison_host_outputs({&*out, &*lse});
  if (const char* err = cpu::sdpa_forward(p, buf)) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

ffi::Error CpuBwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                  ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer mask,
                  ffi::AnyBuffer sinks, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                  ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                  ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                  ffi::Result<ffi::AnyBuffer> dv, SdpaAttrs a) {
  SdpaParams p;
  SdpaBwdBuffers buf;
  const OptionalOperands opt{mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                            kv_segment_ids};
  if (auto e = unpack_backward(a, q, k, v, out, lse, dout, opt, *dq, *dk, *dv, &p, &buf);
      e.failure())
    return e;
  if (auto e = refuse_unserved(p, kServedFeatures, "cpu"); e.failure()) return e;
  poison_host_outputs({&*dq, &*dk, &*dv});
  if (const char* err = cpu::sdpa_backward(p, buf)) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

ffi::Error CpuPagedFwd(ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::AnyBuffer page_indices, ffi::AnyBuffer kv_lengths,
                       ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, SdpaAttrs a) {
  SdpaParams p;
  SdpaFwdBuffers buf;
  if (auto e = unpack_paged_forward(a, q, k_pages, v_pages, page_indices, kv_lengths, sinks,
                                    *out, *lse, &p, &buf);
      e.failure())
    return e;
  if (auto e = refuse_unserved(p, kPagedServedFeatures, "cpu paged"); e.failure()) return e;
  poison_host_outputs({&*out, &*lse});
  if (const char* err = cpu::sdpa_forward(p, buf)) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sdpa

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cpu_fwd, jax_sdpa::CpuFwd,
                           jax_sdpa::bind_sdpa_fwd(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cpu_bwd, jax_sdpa::CpuBwd,
                           jax_sdpa::bind_sdpa_bwd(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cpu_paged_fwd, jax_sdpa::CpuPagedFwd,
                           jax_sdpa::bind_sdpa_paged_fwd(xla::ffi::Ffi::Bind()),
                           jax_sdpa::kPagedServedFeatures);

