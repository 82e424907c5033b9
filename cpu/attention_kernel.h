// Entry points of one ISA variant of the kernel (cpu/attention_kernel.cc is
// compiled once per variant with JAX_SDPA_CPU_ISA set to its namespace name).
// Only plain types cross this boundary: no std templates, so that no inline
// function compiled for a wider ISA can be picked by the linker for a
// narrower caller.
#pragma once

#include "cpu/thread_pool.h"
#include "ffi/sdpa_params.h"

#define JAX_SDPA_CPU_DECLARE_VARIANT(ns)                                             \
  namespace jax_sdpa {                                                               \
  namespace cpu {                                                                    \
  namespace ns {                                                                     \
  const char* forward(const SdpaParams& p, const SdpaFwdBuffers& buf, ThreadPool& pool); \
  const char* backward(const SdpaParams& p, const SdpaBwdBuffers& buf, ThreadPool& pool); \
  }                                                                                  \
  }                                                                                  \
  }

namespace jax_sdpa {
namespace cpu {
// Whether the bfloat16 products may run on AMX tiles (attention_cpu.cc decides once: the
// x86-64-v4-bf16 variant, AMX-BF16 and AMX-TILE, the OS's leave, JAX_SDPA_CPU_AMX != 0).
bool amx_bf16_enabled();
}  // namespace cpu
}  // namespace jax_sdpa

JAX_SDPA_CPU_DECLARE_VARIANT(x86_64_v2)
JAX_SDPA_CPU_DECLARE_VARIANT(x86_64_v3)
JAX_SDPA_CPU_DECLARE_VARIANT(x86_64_v4)
JAX_SDPA_CPU_DECLARE_VARIANT(x86_64_v4_bf16)
JAX_SDPA_CPU_DECLARE_VARIANT(generic)
