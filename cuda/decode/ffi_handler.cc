// XLA FFI handlers `jax_sdpa_cuda_fwd`: our own CUDA decode kernels
// (cuda/decode/decode_attention.*) behind the forward contract of docs/ffi_contract.md, and
// `jax_sdpa_cuda_paged_fwd`, the same decode shapes over a paged K/V cache.
// Few-query attention (Lq * Hq/Hk small) over long key/value caches; the
// backward of these shapes goes to cuDNN or the reference (same lse contract).
//
// Command-buffer (CUDA graph) compatible: besides out and lse the call has a third
// result, a uint8 workspace that XLA allocates (split-K partials + the fused
// combine's counters; layout in cuda/decode/decode_attention.h), so execute does only
// capturable stream work (cudaMemsetAsync + kernel launches) and device/occupancy
// queries: no scratch allocator, no cudaMalloc, no synchronous call.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "cuda/decode/decode_attention.h"
#include "cuda/flash/flash_attention.h"
#include "ffi/registry.h"
#include "ffi/cuda_ffi_util.h"
#include "ffi/ffi_call.h"
#include "ffi/sdpa_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {
namespace {

// The contract features these handlers' kernels serve (ffi/sdpa_params.h Feature): the
// registration below declares them, the handlers refuse every other. A call using one
// (segment ids, soft-capping) runs the flash forward's feature kernel
// (cuda/flash/flash_attention.cuh), which serves every shape the decode kernels do; the
// decode kernels themselves stay feature-free.
constexpr uint32_t kServedFeatures = kFeatureSegmentIds | kFeatureLogitsSoftCap;

namespace ffi = xla::ffi;

// Plans and launches our decode kernels (contiguous or paged K/V) into the call's
// workspace result.
ffi::Error run_decode(const SdpaParams& p, const SdpaFwdBuffers& buf, ffi::AnyBuffer workspace,
                      cudaStream_t stream, const char* who) {
  // The workspace (any dtype, read as bytes; the Python side makes it uint8): its
  // 16-byte aligned part is what the plan may use (XLA's buffers are aligned anyway).
  auto ws = workspace.dimensions();
  if (ws.size() != 1)
    return ffi::Error::InvalidArgument(
        std::string("jax_sdpa ") + who + ": the workspace result must be a 1-D byte buffer");
  char* ws_ptr = static_cast<char*>(workspace.untyped_data());
  size_t ws_bytes = workspace.size_bytes();
  const size_t skew = (16 - reinterpret_cast<uintptr_t>(ws_ptr) % 16) % 16;
  if (ws_ptr == nullptr || ws_bytes < skew) {
    ws_ptr = nullptr;
    ws_bytes = 0;
  } else {
    ws_ptr += skew;
    ws_bytes -= skew;
  }

  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_error(who, "cudaGetDevice", e);
  cuda_decode::DecodePlan plan;
  e = cuda_decode::make_plan(p, device, ws_bytes, &plan);
  if (e != cudaSuccess) return cuda_error(who, "planning the launch", e);
  (void)cudaGetLastError();  // clear a stale error so the launch check reports ours
  e = cuda_decode::launch(p, buf, plan, ws_ptr, ws_bytes, stream);
  if (e != cudaSuccess) return cuda_error(who, "kernel launch", e);
  return ffi::Error::Success();
}

ffi::Error CudaFwdImpl(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       SdpaAttrs attrs) {
  ForwardCall c;
  if (auto e = unpack_forward_call(attrs, args, rets, 1, kServedFeatures, "cuda decode", &c);
      e.failure())
    return e;
  const SdpaParams& p = c.p;
  const SdpaFwdBuffers& buf = c.buf;
  if (auto e = refuse_or_poison("cuda decode", cuda_decode::unsupported_reason(p), stream,
                                {&c.out(), &c.lse()});
      e.failure())
    return e;
  if (p.batch * p.heads_q * p.len_q == 0) return ffi::Error::Success();

  if (p.features() != 0) {
    if (const std::string why = cuda_flash::unsupported_reason(p); !why.empty())
      return ffi::Error(ffi::ErrorCode::kUnimplemented, "jax_sdpa cuda decode: " + why);
    (void)cudaGetLastError();
    // fp32: split-TF32, as accurate as the decode kernels' fp32 FMAs.
    cudaError_t e = cuda_flash::launch_forward(p, buf, cuda_flash::Fp32Mode::kHighest, stream);
    if (e != cudaSuccess) return cuda_error("cuda decode", "feature kernel launch", e);
    return ffi::Error::Success();
  }

  return run_decode(p, buf, c.extra(), stream, "cuda decode");
}

// ---- the paged forward `jax_sdpa_cuda_paged_fwd` ----------------------------------------
// q, k_pages, v_pages, page_indices, kv_lengths, sinks -> out, lse, workspace (the decode
// target's split-K workspace) (docs/ffi_contract.md, "Paged KV"). The pages are read in place:
// by our decode kernel (decode_tc_kernel<..., PAGED>: 16-bit, D = Dv in {64, 128, 256}, no
// soft cap; cuda_decode::paged_unsupported_reason), else by the flash forward's feature
// kernel (cuda/flash/flash_attention.cuh, load_paged_tile). Either way an out-of-range page
// index makes that page's keys invisible and is never dereferenced, and keys past the kv
// length are never read. Soft-capping is served, segment ids can't reach a paged call.
constexpr uint32_t kPagedServedFeatures = kFeatureLogitsSoftCap;

ffi::Error CudaPagedFwdImpl(cudaStream_t stream, ffi::RemainingArgs args,
                            ffi::RemainingRets rets, SdpaAttrs attrs) {
  PagedForwardCall c;
  if (auto e = unpack_paged_forward_call(attrs, args, rets, 1, kPagedServedFeatures,
                                         "cuda paged", &c);
      e.failure())
    return e;
  const SdpaParams& p = c.p;
  const SdpaFwdBuffers& buf = c.buf;
  if (auto e = refuse_or_poison("cuda paged", cuda_flash::unsupported_reason(p), stream,
                                {&c.out(), &c.lse()});
      e.failure())
    return e;
  if (p.batch * p.heads_q * p.len_q == 0) return ffi::Error::Success();
  if (p.features() == 0 && cuda_decode::paged_unsupported_reason(p).empty())
    return run_decode(p, buf, c.extra(), stream, "cuda paged");
  (void)cudaGetLastError();
  // fp32: split-TF32, as accurate as the decode kernels' fp32 FMAs.
  cudaError_t e = cuda_flash::launch_forward(p, buf, cuda_flash::Fp32Mode::kHighest, stream);
  if (e != cudaSuccess) return cuda_error("cuda paged", "kernel launch", e);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sdpa

JAX_SDPA_DEFINE_FFI_TARGET(
    jax_sdpa_cuda_fwd, jax_sdpa::CudaFwdImpl,
    jax_sdpa::bind_call(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    jax_sdpa::kServedFeatures, {xla::ffi::Traits::kCmdBufferCompatible});

JAX_SDPA_DEFINE_FFI_TARGET(
    jax_sdpa_cuda_paged_fwd, jax_sdpa::CudaPagedFwdImpl,
    jax_sdpa::bind_call(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    jax_sdpa::kPagedServedFeatures, {xla::ffi::Traits::kCmdBufferCompatible});

