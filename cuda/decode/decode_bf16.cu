// bf16 instantiations of our decode kernels (tensor cores).
#include "cuda/decode/decode_kernels.h"

JAX_SDPA_DECODE_16BIT_SELECTOR(bf16, __nv_bfloat16)
