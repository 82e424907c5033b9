// Wide-head (256 < D, Dv <= 512) fp16/bf16 flash backward: instantiations + host launcher
// (kernels: cuda/flash_bwd_wide.cuh, API: cuda/flash_bwd_wide.h).
#include "cuda/flash/flash_bwd_wide.h"

#include <cstdint>

#include "cuda/flash/flash_bwd_wgmma.h"
#include "cuda/flash/flash_bwd_wide.cuh"
#include "cuda/flash/flash_launch_checks.h"

namespace jax_sdpa {
namespace cuda_flash {

namespace bwd_wide {
namespace {

template <typename T>
cudaError_t launch_t(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                     float* dq_accum, cudaStream_t stream) {
  auto kernel = flash_bwd_wide_kernel<T>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) !=
      cudaSuccess) {
    (void)cudaGetLastError();  // leave no error behind for the fallback
    return cudaErrorNotSupported;
  }
  // ---- nothing enqueued before this point ----
  if (p.batch == 0 || p.heads_q == 0) return cudaSuccess;
  SdpaFwdBuffers fb;
  fb.q = buf.q;
  fb.k = buf.k;
  fb.v = buf.v;
  Args a;
  a.f = make_fwd_args(p, fb, kD);
  a.out = buf.out;
  a.dout = buf.dout;
  a.lse = buf.lse;
  a.delta = delta;
  a.dq_accum = dq_accum;
  a.dk = buf.dk;
  a.dv = buf.dv;
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);

  const int64_t rows = p.batch * p.heads_q * p.len_q;
  cudaError_t e = cudaSuccess;
  if (rows > 0) {
    e = cudaMemsetAsync(dq_accum, 0, static_cast<size_t>(rows * p.head_dim) * sizeof(float),
                        stream);
    if (e != cudaSuccess) return e;
    wide_delta_kernel<T><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(a, delta, rows);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (p.len_kv > 0 && p.heads_kv > 0) {
    const dim3 grid(static_cast<unsigned>((p.len_kv + kBc - 1) / kBc),
                    static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.batch));
    // On H100 / H200 the wgmma kernel (flash_bwd_wgmma.cu; JAX_SDPA_FLASH_WGMMA_BWD=0 turns
    // it off); it enqueues nothing when it answers cudaErrorNotSupported.
    e = launch_backward_wgmma_main(a, p, stream);
    if (e == cudaErrorNotSupported) {
      kernel<<<grid, kThreads, kSmemBytes, stream>>>(a);
      e = cudaGetLastError();
    }
    if (e != cudaSuccess) return e;
  }
  if (rows > 0) {
    wide_dq_convert_kernel<T><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(
        a, buf.dq, rows);
    e = cudaGetLastError();
  }
  return e;
}

}  // namespace
}  // namespace bwd_wide

bool backward_wide_applies(const SdpaParams& p) {
  return (p.dtype == DType::kF16 || p.dtype == DType::kBF16) && p.head_dim > 256 &&
         p.head_dim_v > 256 && p.head_dim <= bwd_wide::kD && p.head_dim_v <= bwd_wide::kD;
}

size_t backward_wide_accum_bytes(const SdpaParams& p) {
  if (!backward_wide_applies(p)) return 0;
  return static_cast<size_t>(p.batch * p.heads_q * p.len_q * p.head_dim) * sizeof(float);
}

cudaError_t launch_backward_wide(const SdpaParams& p, const SdpaBwdBuffers& buf, float* delta,
                                 float* dq_accum, cudaStream_t stream) {
  using namespace bwd_wide;
  // ---- can we serve it? (nothing is enqueued before these checks pass) ----
  if (!backward_wide_applies(p)) return cudaErrorNotSupported;
  if (p.head_dim % 8 != 0 || p.head_dim_v % 8 != 0) return cudaErrorNotSupported;
  if (!backward_grid_fits(p)) return cudaErrorNotSupported;
  if (delta == nullptr || dq_accum == nullptr) return cudaErrorNotSupported;
  // 16-byte cp.async / vector accesses: strides multiples of 8 elements, 16-byte aligned buffers.
  if (!strides_multiple_of(p, 8) ||
      !all_aligned16({buf.q, buf.k, buf.v, buf.out, buf.dout, buf.dq, buf.dk, buf.dv, dq_accum,
                      delta}))
    return cudaErrorNotSupported;
  if (max_smem_optin() < kSmemBytes) return cudaErrorNotSupported;
  switch (p.dtype) {
    case DType::kF16: return launch_t<__half>(p, buf, delta, dq_accum, stream);
    case DType::kBF16: return launch_t<__nv_bfloat16>(p, buf, delta, dq_accum, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
