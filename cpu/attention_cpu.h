// The native CPU flash-attention kernel (forward + backward).
//
// Consumes the plain SdpaParams of ffi/sdpa_params.h; semantics are those of
// docs/ffi_contract.md. The kernel is compiled once per x86-64 ISA level
// (v2 = SSE4.2, v3 = AVX2+FMA, v4 = AVX-512, v4-bf16 = AVX-512 + AVX512-BF16)
// and the best one the running CPU supports is picked at first use; other
// architectures get one generic build.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cpu {

// Both return nullptr on success, else a static message (e.g. out of memory).
const char* sdpa_forward(const SdpaParams& p, const SdpaFwdBuffers& buf);
const char* sdpa_backward(const SdpaParams& p, const SdpaBwdBuffers& buf);

// The largest head dim (D or Dv) the kernel serves (docs/cpu.md).
constexpr int64_t kMaxHeadDim = 512;

// Empty when the kernel serves `p`'s head dims, else why not. Dispatch asks it
// (`unsupported_reason` of the _sdpa_cpu module) and sends the kernel nothing else; no buffer
// is sized by it, so a direct FFI call with larger head dims still runs.
std::string unsupported_reason(const SdpaParams& p);

// The ISA variant in use ("x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64-v2"
// or "generic").
// JAX_SDPA_CPU_ISA=v2|v3|v4 forces a lower level (for testing).
const char* active_isa();

}  // namespace cpu
}  // namespace jax_sdpa
