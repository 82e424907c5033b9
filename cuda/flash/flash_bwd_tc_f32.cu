// Fast float32 flash-attention backward: instantiations + launcher (see flash_bwd_tc.cuh).
#include "cuda/flash/flash_bwd_tc.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ffi/tuning_knobs.h"
#include "cuda/flash/flash_bwd_tc.cuh"
#include "cuda/flash/flash_tuning.h"
#include "cuda/flash/flash_launch_checks.h"

namespace jax_sdpa {
namespace cuda_flash {
namespace bwd_tc {
namespace {

template <int kMode, int kD, int kBr, int kVar = 0>
cudaError_t launch_t(const Args& a, int hk, cudaStream_t stream) {
  using C = Cfg<kD, kBr>;
  auto kernel = flash_bwd_tc_kernel<kMode, kD, kBr, kVar>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(C::kBytes));
  if (e != cudaSuccess) return e;
  const int key_tiles = (a.f.Lk + kBc - 1) / kBc;
  kernel<<<dim3(key_tiles, hk, a.f.B), kThreads, C::kBytes, stream>>>(a);
  return cudaGetLastError();
}

// The TF32 backward's variant: flash_tuning.h's (flat_ldsm_kvreg); in tuning builds
// JAX_SDPA_FLASH_BWD_VARIANT (read on every call; TF32 mode only, 3xTF32 always runs the
// base kernel) picks another, "base" / unknown = the original kernel (variant 0).
//   flat            no run-time guards in the mma loops (kVarFlat)
//   ldsm            ldmatrix fragments for S^T / dP^T and dQ's dS (kVarLdsm)
//   flat_ldsm       both
//   flat_ldsm_kreg  + K's A fragments in registers (D <= 64 only; D > 64 runs flat_ldsm)
//   flat_ldsm_kvreg + K's and V's A fragments in registers (same)
int variant_from_env() {
  const char* v = tuning_knob("JAX_SDPA_FLASH_BWD_VARIANT");
  if (v == nullptr || *v == 0) return tuning::kBwdTf32Variant;
  if (!std::strcmp(v, "flat")) return kVarFlat;
  if (!std::strcmp(v, "ldsm")) return kVarLdsm;
  if (!std::strcmp(v, "flat_ldsm")) return kVarFlat | kVarLdsm;
  if (!std::strcmp(v, "flat_ldsm_kreg")) return kVarFlat | kVarLdsm | kVarKreg;
  if (!std::strcmp(v, "flat_ldsm_kvreg")) return kVarFlat | kVarLdsm | kVarKreg | kVarVreg;
  return 0;
}

template <int kD, int kBr>
cudaError_t launch_tf32(const Args& a, int hk, int var, cudaStream_t stream) {
  static_assert(tuning::kBwdTf32Variant == (kVarFlat | kVarLdsm | kVarKreg | kVarVreg),
                "the product build instantiates flash_tuning.h's variant");
  switch (var) {
#if JAX_SDPA_TUNING
    case kVarFlat: return launch_t<1, kD, kBr, kVarFlat>(a, hk, stream);
    case kVarLdsm: return launch_t<1, kD, kBr, kVarLdsm>(a, hk, stream);
    case kVarFlat | kVarLdsm: return launch_t<1, kD, kBr, kVarFlat | kVarLdsm>(a, hk, stream);
    case kVarFlat | kVarLdsm | kVarKreg:
      if constexpr (kD <= 64)
        return launch_t<1, kD, kBr, kVarFlat | kVarLdsm | kVarKreg>(a, hk, stream);
      return launch_t<1, kD, kBr, kVarFlat | kVarLdsm>(a, hk, stream);
    default: return launch_t<1, kD, kBr>(a, hk, stream);
#endif
    case kVarFlat | kVarLdsm | kVarKreg | kVarVreg:
      if constexpr (kD <= 64)
        return launch_t<1, kD, kBr, kVarFlat | kVarLdsm | kVarKreg | kVarVreg>(a, hk, stream);
      return launch_t<1, kD, kBr, kVarFlat | kVarLdsm>(a, hk, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace bwd_tc

cudaError_t launch_backward_f32_fast(const SdpaParams& p, const SdpaBwdBuffers& buf,
                                     Fp32Mode mode, float* delta, cudaStream_t stream) {
  using namespace bwd_tc;
  // ---- can we serve it? (nothing is enqueued before these checks pass) ----
  if (p.dtype != DType::kF32) return cudaErrorNotSupported;
  if (p.head_dim < 8 || p.head_dim_v < 8 || p.head_dim > 128 || p.head_dim_v > 128 ||
      p.head_dim % 8 != 0 || p.head_dim_v % 8 != 0)
    return cudaErrorNotSupported;
  if (!backward_grid_fits(p)) return cudaErrorNotSupported;
  // float4 / float2 / 16-byte cp.async accesses: row strides multiples of 4 elements,
  // 16-byte aligned buffers.
  if (!strides_multiple_of(p, 4) ||
      !all_aligned16({buf.q, buf.k, buf.v, buf.out, buf.dout, buf.dq, buf.dk, buf.dv}))
    return cudaErrorNotSupported;
  const bool narrow = p.head_dim <= 64 && p.head_dim_v <= 64;
  const size_t smem = narrow ? Cfg<64, 64>::kBytes : Cfg<128, 32>::kBytes;
  if (static_cast<size_t>(max_smem_optin()) < smem)
    return cudaErrorNotSupported;  // e.g. an A100 (D <= 64)

  // ---- launch ----
  if (p.batch == 0 || p.heads_q == 0) return cudaSuccess;
  SdpaFwdBuffers fb;
  fb.q = buf.q;
  fb.k = buf.k;
  fb.v = buf.v;
  Args a;
  a.f = make_fwd_args(p, fb, 64);
  a.out = static_cast<const float*>(buf.out);
  a.dout = static_cast<const float*>(buf.dout);
  a.lse = buf.lse;
  a.delta = delta;
  a.dq = static_cast<float*>(buf.dq);
  a.dk = static_cast<float*>(buf.dk);
  a.dv = static_cast<float*>(buf.dv);
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);

  const int64_t rows = p.batch * p.heads_q * p.len_q;
  if (rows > 0) {
    // dq is exactly q's shape, dense (either layout): zero it, the kernel adds into it.
    cudaError_t e = cudaMemsetAsync(buf.dq, 0, static_cast<size_t>(rows * p.head_dim) * 4, stream);
    if (e != cudaSuccess) return e;
    delta_kernel<<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(a, delta, rows);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (p.len_kv == 0) return cudaSuccess;  // dk, dv are empty
  const int hk = static_cast<int>(p.heads_kv);
  if (mode == Fp32Mode::kHighest)
    return narrow ? launch_t<2, 64, 64>(a, hk, stream) : launch_t<2, 128, 32>(a, hk, stream);
  const int var = variant_from_env();
  return narrow ? launch_tf32<64, 64>(a, hk, var, stream) : launch_tf32<128, 32>(a, hk, var, stream);
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
