// jax_sdpa._sdpa_cuda: the CUDA-platform FFI handlers as capsules, plus a few
// facts about the cuDNN in the process (for dispatch and `jax-sdpa info`).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cudnn_sdpa.h"
#include "ffi_registry.h"

namespace nb = nanobind;

NB_MODULE(_sdpa_cuda, m) {
  m.doc() = "jax_sdpa NVIDIA backend: cuDNN SDPA graphs (and our CUDA kernels) behind XLA FFI";
  m.def(
      "registrations",
      []() {
        nb::dict d;
        for (const auto& t : jax_sdpa::cuda_ffi_targets())
          d[t.name.c_str()] = nb::capsule(t.handler);
        return d;
      },
      "{FFI target name: capsule} for jax.ffi.register_ffi_target(..., platform='CUDA').");
  m.def("cudnn_version", &jax_sdpa::cudnn::runtime_version,
        "Version of the libcudnn loaded in this process (e.g. 91900), -1 if it can't be queried.");
  m.def("cudnn_compiled_version", &jax_sdpa::cudnn::compiled_version,
        "CUDNN_VERSION of the headers this module was built with.");
  m.def("cudnn_frontend_version", &jax_sdpa::cudnn::frontend_version,
        "cudnn-frontend version this module was built with (e.g. 11600).");
  m.def("graph_cache_size", &jax_sdpa::cudnn::graph_cache_size,
        "Number of cuDNN graphs cached now (all devices).");
  m.def("graph_cache_capacity", &jax_sdpa::cudnn::graph_cache_capacity,
        "Capacity of the graph cache (env JAX_SDPA_CUDNN_CACHE_SIZE, default 256).");
  m.def("clear_graph_cache", &jax_sdpa::cudnn::clear_graph_cache,
        "Drops every cached cuDNN graph.");
}
