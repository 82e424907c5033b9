// bf16 instantiations of our decode kernels (tensor cores); see decode_attention.cu.
#include "decode_attention_kernels.h"

namespace jax_sdpa {
namespace cuda_decode {

KernelInfo select_bf16(int64_t d, int64_t dv, bool rows16, const KernelChoice& want) {
#define JAX_SDPA_X(D_, DV_)                                                   \
  if (d == D_ && dv == DV_) {                                                 \
    if constexpr (DV_ <= 256) {                                               \
      if (rows16) return tc_select<__nv_bfloat16, D_, DV_, 2>(want); \
    }                                                                         \
    return tc_select<__nv_bfloat16, D_, DV_, 1>(want);               \
  }
  JAX_SDPA_DECODE_DIMS(JAX_SDPA_X)
#undef JAX_SDPA_X
  return KernelInfo{};
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
