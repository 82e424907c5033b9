// nanobind module _sdpa_cpu: the CPU FFI handlers (cpu/ffi_handler.cc) for jax_sdpa/_ext.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "cpu/attention_cpu.h"
#include "cpu/thread_pool.h"
#include "ffi/module_registrations.h"

namespace nb = nanobind;

NB_MODULE(_sdpa_cpu, m) {
  m.doc() = "jax_sdpa native CPU flash-attention kernel (XLA FFI handlers)";
  jax_sdpa::def_registrations(m);
  m.def("isa", [] { return std::string(jax_sdpa::cpu::active_isa()); },
        "The kernel variant picked for this CPU (x86-64-v4-bf16/v4/v3/v2 or generic).");
  m.def("num_threads", [] { return jax_sdpa::cpu::ThreadPool::global().participants(); },
        "Threads the kernel runs on (JAX_SDPA_CPU_THREADS overrides).");
  m.def(
      "unsupported_reason",
      [](int64_t head_dim, int64_t head_dim_v) {
        jax_sdpa::SdpaParams p;
        p.head_dim = head_dim;
        p.head_dim_v = head_dim_v;
        return jax_sdpa::cpu::unsupported_reason(p);
      },
      nb::arg("head_dim"), nb::arg("head_dim_v"),
      "Why the kernel can't serve these head dims ('' when it can).");
}
