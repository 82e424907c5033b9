// jax_sdpa._sdpa_cuda: the CUDA-platform FFI handlers as capsules, and what the native code
// knows that dispatch needs (jax_sdpa/dispatch.py asks these, never re-derives them): the
// decode kernels' workspace bytes, default kernel and refusals, the flash kernels' refusals
// and wgmma availability, cuDNN's band alignment and refusals, and the cuDNN in the process.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cuda/cudnn/cudnn_sdpa.h"
#include "cuda/decode/decode_attention.h"
#include "cuda/flash/flash_attention.h"
#include "ffi/module_facts.h"
#include "ffi/module_registrations.h"
#include "ffi/sdpa_params.h"

namespace nb = nanobind;

using jax_sdpa::def_shape_fact;
using jax_sdpa::shape_params;

NB_MODULE(_sdpa_cuda, m) {
  namespace decode = jax_sdpa::cuda_decode;
  namespace flash = jax_sdpa::cuda_flash;
  m.doc() = "jax_sdpa NVIDIA backend: cuDNN SDPA graphs and our CUDA kernels behind XLA FFI";
  jax_sdpa::def_registrations(m);

  def_shape_fact(m, "decode_unsupported_reason", &decode::unsupported_reason,
                 "Why the decode kernels can't serve these shapes ('' when they can).");
  m.def(
      "decode_workspace_bytes",
      [](int64_t b, int64_t hq, int64_t hk, int64_t lq, int64_t lk, int64_t dv) {
        return decode::workspace_bytes(shape_params("float32", b, hq, hk, lq, lk, dv, dv));
      },
      nb::arg("batch"), nb::arg("heads_q"), nb::arg("heads_kv"), nb::arg("len_q"),
      nb::arg("len_kv"), nb::arg("head_dim_v"),
      "Bytes of the decode target's uint8 workspace result for these shapes (>= 256).");
  def_shape_fact(
      m, "decode_default_kernel",
      [](const jax_sdpa::SdpaParams& p) { return std::string(decode::default_kernel_name(p)); },
      "The decode kernel the default plan runs on an sm_90+ GPU ('' where not built).");
  def_shape_fact(m, "paged_decode_unsupported_reason", &decode::paged_unsupported_reason,
                 "Why the decode kernels can't read a paged call of these shapes in place ('' "
                 "when they can; the paged target then runs the flash feature kernel).");
  def_shape_fact(m, "flash_unsupported_reason", &flash::unsupported_reason,
                 "Why the flash kernels can't serve these shapes ('' when they can).");
  m.def(
      "flash_wgmma_serves",
      [](bool backward, const std::string& dtype, int64_t d, int64_t dv, int cc_major,
         int cc_minor) {
        return flash::wgmma_serves(backward, shape_params(dtype, 1, 1, 1, 1, 1, d, dv), cc_major,
                                   cc_minor);
      },
      nb::arg("backward"), nb::arg("dtype"), nb::arg("head_dim"), nb::arg("head_dim_v"),
      nb::arg("cc_major"), nb::arg("cc_minor"),
      "Whether the wgmma flash kernel of this direction runs these head dims on a GPU of this "
      "compute capability (and JAX_SDPA_FLASH_WGMMA / _BWD is not 0).");
  m.def(
      "cudnn_bottom_right_aligned",
      [](int64_t lq, int64_t lk, int64_t window_left, int64_t window_right, bool bottom_right,
         bool has_lengths) {
        jax_sdpa::SdpaParams p = shape_params("float16", 1, 1, 1, lq, lk, 8, 8);
        p.window_left = window_left;
        p.window_right = window_right;
        p.bottom_right = bottom_right;
        return jax_sdpa::cudnn::bottom_right_aligned(p, has_lengths);
      },
      nb::arg("len_q"), nb::arg("len_kv"), nb::arg("window_left"), nb::arg("window_right"),
      nb::arg("bottom_right"), nb::arg("has_lengths"),
      "Whether our cuDNN graph asks for a bottom-right aligned band for this call.");
  m.def(
      "cudnn_unsupported_reason",
      [](int64_t batch, double logits_soft_cap, bool has_lengths, bool per_batch_sinks) {
        jax_sdpa::SdpaParams p = shape_params("float16", batch, 1, 1, 1, 1, 8, 8);
        p.logits_soft_cap = logits_soft_cap;
        return jax_sdpa::cudnn::unsupported_reason(p, has_lengths, per_batch_sinks);
      },
      nb::arg("batch"), nb::arg("logits_soft_cap"), nb::arg("has_lengths"),
      nb::arg("per_batch_sinks"),
      "Why our cuDNN graphs refuse a call for what it combines ('' when they don't).");
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
