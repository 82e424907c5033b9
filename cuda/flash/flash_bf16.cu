// bf16 instantiations of the flash forward + backward kernels (flash_16bit.cuh).
#include "cuda/flash/flash_16bit.cuh"

JAX_SDPA_FLASH_16BIT_LAUNCHERS(bf16, __nv_bfloat16)
