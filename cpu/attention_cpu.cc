// Picks the kernel variant for the running CPU once and forwards to it.
#include "cpu/attention_cpu.h"

#include <cstdlib>
#include <cstring>
#if defined(JAX_SDPA_CPU_BF16_VARIANT) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/attention_kernel.h"
#include "cpu/thread_pool.h"

namespace jax_sdpa {
namespace cpu {
namespace {

struct Variant {
  const char* name;
  const char* (*fwd)(const SdpaParams&, const SdpaFwdBuffers&, ThreadPool&);
  const char* (*bwd)(const SdpaParams&, const SdpaBwdBuffers&, ThreadPool&);
};

Variant pick() {
#if defined(JAX_SDPA_CPU_X86_VARIANTS)
  int max_level = 5;  // 5: v4 with AVX512-BF16
  if (const char* env = std::getenv("JAX_SDPA_CPU_ISA")) {
    if (!std::strcmp(env, "v2")) max_level = 2;
    if (!std::strcmp(env, "v3")) max_level = 3;
    if (!std::strcmp(env, "v4")) max_level = 4;
  }
  __builtin_cpu_init();
  // The checks mirror what -march=x86-64-v4 / -v3 let the compiler use.
  bool v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            __builtin_cpu_supports("bmi2");
  bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
            __builtin_cpu_supports("avx");
  bool v2 = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt") &&
            __builtin_cpu_supports("ssse3");
#if defined(JAX_SDPA_CPU_BF16_VARIANT)
  if (v4 && max_level >= 5 && __builtin_cpu_supports("avx512bf16"))
    return {"x86-64-v4-bf16", x86_64_v4_bf16::forward, x86_64_v4_bf16::backward};
#endif
  if (v4 && max_level >= 4) return {"x86-64-v4", x86_64_v4::forward, x86_64_v4::backward};
  if (v3 && max_level >= 3) return {"x86-64-v3", x86_64_v3::forward, x86_64_v3::backward};
  if (v2) return {"x86-64-v2", x86_64_v2::forward, x86_64_v2::backward};
  return {"generic", generic::forward, generic::backward};
#else
  return {"generic", generic::forward, generic::backward};
#endif
}

const Variant& variant() {
  static const Variant v = pick();
  return v;
}

}  // namespace

const char* sdpa_forward(const SdpaParams& p, const SdpaFwdBuffers& buf) {
  return variant().fwd(p, buf, ThreadPool::global());
}
const char* sdpa_backward(const SdpaParams& p, const SdpaBwdBuffers& buf) {
  return variant().bwd(p, buf, ThreadPool::global());
}
const char* active_isa() { return variant().name; }

bool amx_bf16_enabled() {
  static const bool on = [] {
#if defined(JAX_SDPA_CPU_BF16_VARIANT) && defined(__linux__)
    if (const char* env = std::getenv("JAX_SDPA_CPU_AMX"))
      if (!std::strcmp(env, "0")) return false;
    if (variant().bwd != x86_64_v4_bf16::backward) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    // Linux hands a process the tile data state only when asked (arch_prctl
    // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a tile instruction before that faults.
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return on;
}

std::string unsupported_reason(const SdpaParams& p) {
  const int64_t widest = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  if (widest > kMaxHeadDim)
    return "head dim " + std::to_string(widest) + " > " + std::to_string(kMaxHeadDim);
  return "";
}

}  // namespace cpu
}  // namespace jax_sdpa
