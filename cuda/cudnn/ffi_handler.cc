// XLA FFI handlers jax_sdpa_cudnn_fwd / jax_sdpa_cudnn_bwd (platform "CUDA"), and
// jax_sdpa_cudnn_fwd_no_lse: the forward of a call whose lse nobody reads (its lse result is
// f32 [0]; cuDNN skips its softmax stats where the row fix-up doesn't need them).
// Unpack + check the call (ffi/ffi_call.h), then run the cuDNN graphs in
// cuda/cudnn/cudnn_sdpa.cc. Each target returns a uint8 workspace after its contract results,
// sized at lowering by cudnn::scratch_bytes (the `cudnn_workspace_bytes` binding): the
// graphs' scratch comes out of it, so the handlers only enqueue stream work and are declared
// command-buffer compatible (XLA captures them into CUDA graphs, as it does its own cuDNN
// calls). A workspace too small for this device's plan (sized for another GPU or cuDNN, or
// lowered where no GPU was visible) is topped up from XLA's scratch allocator, which only a
// call that is not being captured may use.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/cudnn/cudnn_sdpa.h"
#include "ffi/registry.h"
#include "ffi/cuda_ffi_util.h"
#include "ffi/ffi_call.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {
namespace {

// The contract features these handlers' kernels serve (ffi/sdpa_params.h Feature): the
// registration below declares them, the handlers refuse every other.
constexpr uint32_t kServedFeatures = kFeatureLogitsSoftCap;

namespace ffi = xla::ffi;

// The call's workspace result, handed out in kScratchAlignment pieces; past its end, XLA's
// scratch allocator when the stream is not being captured (memory it frees when the call
// returns would be reused under a replayed graph).
class CallScratch final : public cudnn::Scratch {
 public:
  CallScratch(ffi::AnyBuffer workspace, ffi::ScratchAllocator& fallback, cudaStream_t stream)
      : base_(reinterpret_cast<uintptr_t>(workspace.untyped_data())),
        end_(base_ + workspace.size_bytes()),
        next_(base_),
        fallback_(fallback) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    capturing_ = cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
                 capture != cudaStreamCaptureStatusNone;
  }

  void* allocate(size_t bytes, size_t alignment) override {
    const uintptr_t a = std::max<uintptr_t>(alignment, cudnn::kScratchAlignment);
    const uintptr_t at = (next_ + a - 1) / a * a;
    if (base_ != 0 && at + bytes <= end_) {
      next_ = at + bytes;
      return reinterpret_cast<void*>(at);
    }
    short_ = true;
    if (capturing_) return nullptr;
    auto mem = fallback_.Allocate(bytes, alignment);
    return mem.has_value() ? *mem : nullptr;
  }

  // The error of a call that ran out of workspace while being captured, with what to do.
  ffi::Error explain(ffi::Error e) const {
    if (!e.failure() || !short_ || !capturing_) return e;
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jax_sdpa cudnn: the call's workspace (" + std::to_string(end_ - base_) +
                          " bytes, sized when it was lowered) is too small for this device's "
                          "cuDNN plan, and XLA is capturing the call into a CUDA graph, where "
                          "no other scratch can be taken: lower it again on this machine (" +
                          e.message() + ")");
  }

 private:
  uintptr_t base_, end_, next_;
  ffi::ScratchAllocator& fallback_;
  bool capturing_ = false;
  bool short_ = false;
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
ffi::Error CudnnFwd(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::RemainingArgs args,
                    ffi::RemainingRets rets, SdpaAttrs attrs) {
  ForwardCall c;
  if (auto e = unpack_forward_call(attrs, args, rets, 1, kServedFeatures, "cudnn", &c,
                                   kLseWanted);
      e.failure())
    return e;
  if (auto e = poison_outputs("cudnn", stream, {&c.out(), &c.lse()}); e.failure()) return e;
  CallScratch s(c.extra(), scratch, stream);
  return s.explain(to_ffi(cudnn::sdpa_forward(c.p, c.buf, stream, s)));
}

ffi::Error CudnnBwd(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::RemainingArgs args,
                    ffi::RemainingRets rets, SdpaAttrs attrs) {
  BackwardCall c;
  if (auto e = unpack_backward_call(attrs, args, rets, 1, kServedFeatures, "cudnn", &c);
      e.failure())
    return e;
  if (auto e = poison_outputs("cudnn", stream, {&c.dq(), &c.dk(), &c.dv()}); e.failure())
    return e;
  CallScratch s(c.extra(), scratch, stream);
  return s.explain(to_ffi(cudnn::sdpa_backward(c.p, c.buf, stream, s)));
}

}  // namespace
}  // namespace jax_sdpa

namespace ffi = xla::ffi;

namespace jax_sdpa {
namespace {

auto cudnn_call() {
  return bind_call(
      ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>());
}

}  // namespace
}  // namespace jax_sdpa

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cudnn_fwd, jax_sdpa::CudnnFwd<true>,
                           jax_sdpa::cudnn_call(),
                           jax_sdpa::kServedFeatures, {ffi::Traits::kCmdBufferCompatible});

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cudnn_fwd_no_lse, jax_sdpa::CudnnFwd<false>,
                           jax_sdpa::cudnn_call(),
                           jax_sdpa::kServedFeatures, {ffi::Traits::kCmdBufferCompatible});

JAX_SDPA_DEFINE_FFI_TARGET(jax_sdpa_cudnn_bwd, jax_sdpa::CudnnBwd,
                           jax_sdpa::cudnn_call(),
                           jax_sdpa::kServedFeatures, {ffi::Traits::kCmdBufferCompatible});
