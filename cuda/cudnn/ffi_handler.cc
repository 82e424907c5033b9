// XLA FFI handlers jax_sdpa_cudnn_fwd / jax_sdpa_cudnn_bwd (platform "CUDA"), and
// jax_sdpa_cudnn_fwd_no_lse: the forward of a call whose lse nobody reads (lse comes back
// NaN; cuDNN skips its softmax stats where the row fix-up doesn't need them).
// Unpack + check the call (ffi/ffi_args.h), then run the cuDNN graphs in
// cuda/cudnn/cudnn_sdpa.cc. Not declared command-buffer compatible: the workspace
// comes from the ScratchAllocator, which CUDA-graph capture does not allow.
#include <cuda_runtime.h>

#include "cuda/cudnn/cudnn_sdpa.h"
#include "ffi/registry.h"
#include "ffi/cuda_ffi_util.h"
#include "ffi/ffi_args.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {
namespace {

// The contract features these handlers' kernels serve (ffi/sdpa_params.h Feature): the
// registration below declares them, the handlers refuse every other.
constexpr uint32_t kServedFeatures = kFeatureLogitsSoftCap;

namespace ffi = xla::ffi;

class FfiScratch final : public cudnn::Scratch {
 public:
  explicit FfiScratch(ffi::ScratchAllocator& a) : alloc_(a) {}
  void* allocate(size_t bytes, size_t alignment) override {
    auto mem = alloc_.Allocate(bytes, alignment);
    return mem.has_value() ? *mem : nullptr;
  }

 private:
  ffi::ScratchAllocator& alloc_;
};

ffi::Error to_ffi(const cudnn::Status& st) {
  switch (st.code) {
    case cudnn::Status::kOk: return ffi::Error::Success();
    case cudnn::Status::kInvalidArgument: return ffi::Error::InvalidArgument(st.message);
    case cudnn::Status::kUnimplemented:
      return ffi::Error(ffi::ErrorCode::kUnimplemented, st.message);
    case cudnn::Status::kResourceExhausted:
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, st.message);
    default: return ffi::Error::Internal(st.message);
  }
}

template <bool kLseWanted>
ffi::Error CudnnFwd(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                    ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer mask, ffi::AnyBuffer sinks,
                    ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                    ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                    SdpaAttrs attrs) {
  SdpaParams p;
  SdpaFwdBuffers b;
  const OptionalOperands opt{mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                            kv_segment_ids};
  if (auto e = unpack_forward(attrs, q, k, v, opt, *out, *lse, &p, &b); e.failure())
    return e;
  if (auto e = refuse_unserved(p, kServedFeatures, "cudnn"); e.failure()) return e;

  if (auto e = poison_outputs("cudnn", stream, {&*out, &*lse}); e.failure()) return e;

  FfiScratch s(scratch);
  return to_ffi(cudnn::sdpa_forward(p, b, stream, s, kLseWanted));
}

ffi::Error CudnnBwd(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                    ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                    ffi::AnyBuffer dout, ffi::AnyBuffer mask, ffi::AnyBuffer sinks,
                    ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                    ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, SdpaAttrs attrs) {
  SdpaParams p;
  SdpaBwdBuffers b;
  const OptionalOperands opt{mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                            kv_segment_ids};
  if (auto e = unpack_backward(attrs, q, k, v, out, lse, dout, opt, *dq, *dk, *dv, &p, &b);
      e.failure())
    return e;
  if (auto e = refuse_unserved(p, kServedFeatures, "cudnn"); e.failure()) return e;

  if (auto e = poison_outputs("cudnn", stream, {&*dq, &*dk, &*dv}); e.failure()) return e;

  FfiScratch s(scratch);
  return to_ffi(cudnn::sdpa_backward(p, b, stream, s));
}

}  // namespace
}  // namespace jax_sdpa

namespace ffi = xla::ffi;

JAX_SDPA_DEFINE_FFI_TARGET(
    jax_sdpa_cudnn_fwd, jax_sdpa::CudnnFwd<true>,
    jax_sdpa::bind_sdpa_fwd(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()),
    jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(
    jax_sdpa_cudnn_fwd_no_lse, jax_sdpa::CudnnFwd<false>,
    jax_sdpa::bind_sdpa_fwd(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()),
    jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(
    jax_sdpa_cudnn_bwd, jax_sdpa::CudnnBwd,
    jax_sdpa::bind_sdpa_bwd(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()),
    jax_sdpa::kServedFeatures);

