// nanobind module _sdpa_cpu: the CPU FFI handlers (cpu/ffi_handler.cc) for jax_sdpa/_ext.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cpu/attention_cpu.h"
#include "cpu/attention_kernel.h"
#include "cpu/thread_pool.h"
#include "ffi/module_facts.h"
#include "ffi/module_registrations.h"

namespace nb = nanobind;

NB_MODULE(_sdpa_cpu, m) {
  m.doc() = "jax_sdpa native CPU flash-attention kernel (XLA FFI handlers)";
  jax_sdpa::def_registrations(m);
  m.def("isa", [] { return std::string(jax_sdpa::cpu::active_isa()); },
        "The kernel variant picked for this CPU (x86-64-v4-bf16/v4/v3/v2 or generic).");
  m.def("amx", [] { return jax_sdpa::cpu::amx_bf16_enabled(); },
        "Whether the bfloat16 products run on AMX tiles (CPU, OS and JAX_SDPA_CPU_AMX allow).");
  m.def("num_threads", [] { return jax_sdpa::cpu::ThreadPool::global().cores(); },
        "Threads the kernel runs on while the machine is quiet (JAX_SDPA_CPU_THREADS "
        "overrides); twice as many while other processes keep the cores busy.");
  m.def("oversubscribed", [] { return jax_sdpa::cpu::ThreadPool::global().oversubscribed(); },
        "Whether the kernel's jobs now go to twice num_threads() threads (the cores were "
        "found busy with other work within the last busy_verdict_seconds()).");
  m.def("busy_verdict_seconds", &jax_sdpa::cpu::ThreadPool::busy_verdict_seconds,
        "How long a verdict that the cores are busy lasts without a long job confirming it.");
  jax_sdpa::def_shape_fact(m, "unsupported_reason", &jax_sdpa::cpu::unsupported_reason,
                           "Why the kernel can't serve these shapes ('' when it can).");
}
