// XLA FFI handlers `jax_sdpa_cuda_flash_fwd` / `_bwd`: our own CUDA flash-attention
// prefill kernels (cuda/flash/flash_attention*) behind the forward/backward contract of
// docs/ffi_contract.md. `implementation="cuda"` routes here for everything the decode
// kernel (`jax_sdpa_cuda_fwd`) does not take (jax_sdpa/dispatch.py: cuda_kernel).
//
// fp32 precision: the contract's `fp32_precision` attribute (set by jax_sdpa from JAX's
// default matmul precision at trace time) picks plain TF32 (0, default) or the
// split-TF32 "3xTF32" kernels (1, highest: ~fp32 accurate). Benchmarks may override it
// for every call of the process with JAX_SDPA_CUDA_FP32=tf32|highest (read once).
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>

#include "ffi/registry.h"
#include "ffi/tuning_knobs.h"
#include "cuda/flash/flash_attention.h"
#include "ffi/cuda_ffi_util.h"
#include "ffi/ffi_call.h"
#include "ffi/sdpa_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {
namespace {

// The contract features these handlers' kernels serve (ffi/sdpa_params.h Feature): the
// registration below declares them, the handlers refuse every other. Segment ids and
// soft-capping run the generic kernels' feature instantiations (cuda/flash/flash_attention*.cuh).
constexpr uint32_t kServedFeatures = kFeatureSegmentIds | kFeatureLogitsSoftCap;

namespace ffi = xla::ffi;

// JAX_SDPA_CUDA_FP32 (benchmarks only): "tf32" or "highest" overrides the attribute.
// -1: not set (or another value), use the attribute.
int fp32_override() {
  static const int m = [] {
    const char* v = tuning_knob("JAX_SDPA_CUDA_FP32");
    if (v == nullptr) return -1;
    if (std::string(v) == "highest") return static_cast<int>(kFp32PrecisionHighest);
    if (std::string(v) == "tf32") return static_cast<int>(kFp32PrecisionDefault);
    return -1;
  }();
  return m;
}

cuda_flash::Fp32Mode fp32_mode(const SdpaAttrs& attrs) {
  const int64_t precision = fp32_override() >= 0 ? fp32_override() : attrs.fp32_precision;
  return precision == kFp32PrecisionHighest ? cuda_flash::Fp32Mode::kHighest
                                            : cuda_flash::Fp32Mode::kTf32;
}

ffi::Error CudaFlashFwdImpl(cudaStream_t stream, ffi::RemainingArgs args,
                            ffi::RemainingRets rets, SdpaAttrs attrs) {
  ForwardCall c;
  if (auto e = unpack_forward_call(attrs, args, rets, 0, kServedFeatures, "cuda flash", &c);
      e.failure())
    return e;
  const SdpaParams& p = c.p;
  if (auto e = refuse_or_poison("cuda flash", cuda_flash::unsupported_reason(p), stream,
                                {&c.out(), &c.lse()});
      e.failure())
    return e;
  if (p.batch * p.heads_q * p.len_q == 0) return ffi::Error::Success();

  (void)cudaGetLastError();  // clear a stale error so the launch check reports ours
  cudaError_t e = cuda_flash::launch_forward(p, c.buf, fp32_mode(attrs), stream);
  if (e != cudaSuccess) return cuda_error("cuda flash", "forward launch", e);
  return ffi::Error::Success();
}

ffi::Error CudaFlashBwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                            ffi::RemainingArgs args, ffi::RemainingRets rets, SdpaAttrs attrs) {
  BackwardCall c;
  if (auto e = unpack_backward_call(attrs, args, rets, 0, kServedFeatures, "cuda flash", &c);
      e.failure())
    return e;
  const SdpaParams& p = c.p;
  if (auto e = refuse_or_poison("cuda flash", cuda_flash::unsupported_reason(p), stream,
                                {&c.dq(), &c.dk(), &c.dv()});
      e.failure())
    return e;
  if (c.dq().size_bytes() + c.dk().size_bytes() + c.dv().size_bytes() == 0)
    return ffi::Error::Success();
  if (static_cast<int64_t>(p.batch) * p.heads_q * p.len_q * p.len_kv == 0) {
    // no query meets a key (e.g. zero query heads): every gradient is 0, and no kernel's
    // grid covers dk / dv then
    for (const ffi::AnyBuffer* g : {&c.dq(), &c.dk(), &c.dv()}) {
      cudaError_t e = cudaMemsetAsync(g->untyped_data(), 0, g->size_bytes(), stream);
      if (e != cudaSuccess) return cuda_error("cuda flash", "zeroing the gradients", e);
    }
    return ffi::Error::Success();
  }

  void* work = nullptr;
  if (auto err = allocate_scratch(scratch, cuda_flash::backward_scratch_bytes(p), "cuda flash",
                                  "backward scratch", &work);
      err.failure())
    return err;
  (void)cudaGetLastError();
  cudaError_t e = cuda_flash::launch_backward(p, c.buf, fp32_mode(attrs), work, stream);
  if (e != cudaSuccess) return cuda_error("cuda flash", "backward launch", e);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sdpa

JAX_SDPA_DEFINE_FFI_TARGET(
    jax_sdpa_cuda_flash_fwd, jax_sdpa::CudaFlashFwdImpl,
    jax_sdpa::bind_call(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    jax_sdpa::kServedFeatures);

JAX_SDPA_DEFINE_FFI_TARGET(
    jax_sdpa_cuda_flash_bwd, jax_sdpa::CudaFlashBwdImpl,
    jax_sdpa::bind_call(xla::ffi::Ffi::Bind()
                            .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                            .Ctx<xla::ffi::ScratchAllocator>()),
    jax_sdpa::kServedFeatures);

