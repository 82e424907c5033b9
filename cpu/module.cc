// nanobind module _sdpa_cpu: hands the CPU FFI handlers to jax_sdpa/_ext.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cpu/attention_cpu.h"
#include "cpu/thread_pool.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxSdpaCpuFwd(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxSdpaCpuBwd(XLA_FFI_CallFrame* call_frame);

namespace nb = nanobind;

NB_MODULE(_sdpa_cpu, m) {
  m.doc() = "jax_sdpa native CPU flash-attention kernel (XLA FFI handlers)";
  m.def("registrations", [] {
    nb::dict d;
    d["jax_sdpa_cpu_fwd"] = nb::capsule(reinterpret_cast<void*>(JaxSdpaCpuFwd));
    d["jax_sdpa_cpu_bwd"] = nb::capsule(reinterpret_cast<void*>(JaxSdpaCpuBwd));
    return d;
  });
  m.def("isa", [] { return std::string(jax_sdpa::cpu::active_isa()); },
        "The kernel variant picked for this CPU (x86-64-v4/v3/v2 or generic).");
  m.def("num_threads", [] { return jax_sdpa::cpu::ThreadPool::global().participants(); },
        "Threads the kernel runs on (JAX_SDPA_CPU_THREADS overrides).");
}
