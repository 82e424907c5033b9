// bf16 instantiations of our decode kernels (tensor cores); see decode_attention.cu.
#include "cuda/decode/decode_kernels.h"

namespace jax_sdpa {
namespace cuda_decode {

KernelInfo select_bf16(int64_t d, int64_t dv, bool rows16, const KernelVariant& want) {
  return select_tc<__nv_bfloat16>(d, dv, rows16, want);
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
